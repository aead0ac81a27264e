# The two commands a newcomer needs:  `make train`  (the main job)  and  `make test`  (the test suite).
# Each installs what it needs first (torch pinned to 2.13.0: see requirements.txt).
PYTHON ?= python3
STAMP := .install-stamp

.PHONY: install train test lint gpu-test cuda-check

install: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# Two processes on gloo (CPU), experts split over both (EP = 2); micro-batch 16 per rank keeps the global
# batch of the single-process run (python3 tools/pretrain_gpt.py --config configs/tiny.yaml).
train: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 tools/pretrain_gpt.py \
		--config configs/tiny.yaml --expert-model-parallel-size 2 --micro-batch-size 16 $(ARGS)

test: install
	$(PYTHON) -m pytest -q $(ARGS)

# ruff with the rules of pyproject.toml's [tool.ruff] (CI runs it first).
lint: install
	$(PYTHON) -m ruff check .

# On a CUDA machine: the GPU tests, then the parallel suite on NCCL (world-4 tests skip on fewer GPUs).
gpu-test: install
	$(PYTHON) -m pytest -q -m gpu $(ARGS)
	MOE_CORE_TEST_BACKEND=nccl $(PYTHON) -m pytest -q tests/parallel $(ARGS)

# Compiles csrc/cuda for sm_90a with CUTLASS, without a GPU: needs only nvcc on the PATH. CI runs it with
# ARGS="--changed-since BASE" (only what a change can break); plain `make cuda-check` compiles everything.
cuda-check: install
	$(PYTHON) -m pip install -q nvidia-cutlass==4.2.0.0
	$(PYTHON) tools/check_cuda_compile.py $(ARGS)
