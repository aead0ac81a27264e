import os

import pytest
import torch

# Tests build their Hugging Face models locally and never download: transformers and huggingface_hub fail
# instead of reaching the network (spawned ranks inherit the variable).
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
