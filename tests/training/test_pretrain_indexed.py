"""Pretraining on a blend of indexed datasets with document masking: flags, resume, masked-loss accounting."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training, train_step
from moe_core.training.trainer import pretrain
from tests.training._tokenizers import build_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402
import pretrain_gpt  # noqa: E402

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--seq-length", "16", "--micro-batch-size", "4",
        "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "2",
        "--moe-input-jitter-eps", "0.1"]
MASKS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two indexed datasets (documents ending in the EOD token) and the tokenizer that wrote them."""
    root = tmp_path_factory.mktemp("indexed")
    tokenizer = build_tokenizer_dir(root / "tokenizer")
    prefixes = []
    for name, words in (("code", "def add(a, b): return a + b"), ("prose", "the quick brown fox jumps")):
        source = root / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": f"{words} {i} " * (1 + i % 4)}) + "\n" for i in range(200)))
        preprocess_data.main(["--input", str(source), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                              str(tokenizer), "--append-eod", "--output-prefix", str(root / name)])
        prefixes.append(str(root / f"{name}_text_document"))
    return prefixes, str(tokenizer / "tokenizer.json")


def run(tmp_path, corpus, name, *extra):
    prefixes, tokenizer = corpus
    flags = TINY + ["--data-path", "0.3", prefixes[0], "0.7", prefixes[1], "--split", "90,10,0", "--tokenizer",
                    tokenizer, "--output-dir", str(tmp_path / name), *extra]
    model, training = pretrain_gpt.parse_args(flags)
    return pretrain(model, training, log=lambda *_: None), tmp_path / name


def test_blend_with_document_masks_trains_and_resumes_bitwise(tmp_path, corpus):
    flags = ["--train-iters", "6", *MASKS]
    straight, out = run(tmp_path, corpus, "straight", *flags)
    first, _ = run(tmp_path, corpus, "resumed", *flags, "--exit-interval", "3", "--save", str(tmp_path / "ckpt"))
    resumed, _ = run(tmp_path, corpus, "resumed", *flags, "--load", str(tmp_path / "ckpt"))
    assert first.train_losses + resumed.train_losses == straight.train_losses
    assert resumed.end_valid_loss == straight.end_valid_loss
    assert straight.start_valid_loss == pytest.approx(math.log(400), abs=0.5) and all(
        math.isfinite(x) for x in straight.train_losses)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(rows) == 6 and all(0 <= r["data_wait_ms"] and 0 <= r["data_wait_fraction"] < 1 for r in rows)
    # The masks reach the model: without them the same batches give other losses.
    unmasked, _ = run(tmp_path, corpus, "unmasked", "--train-iters", "6")
    assert unmasked.train_losses[0] != straight.train_losses[0]


@pytest.mark.parametrize("flag", MASKS)
def test_masks_need_an_eod_token_and_indexed_data(tmp_path, corpus, flag):
    prefixes, tokenizer = corpus
    text = tmp_path / "a.txt"
    text.write_text("some text " * 100)
    with pytest.raises(ValueError, match=rf"{flag[2:].replace('-', '_')}: need documents that end in an EOD token"):
        pretrain(*pretrain_gpt.parse_args(TINY + ["--data-path", str(text), flag, "--train-iters", "1"]))
    with pytest.raises(ValueError, match=rf"{flag[2:].replace('-', '_')}: need the EOD token id: --tokenizer with an "
                                         r"eos_token .*got tokenizer=None"):
        pretrain(*pretrain_gpt.parse_args(TINY + ["--data-path", prefixes[0], flag, "--train-iters", "1"]))
    with pytest.raises(ValueError, match="split: applies to indexed datasets and SFT data"):
        pretrain(*pretrain_gpt.parse_args(TINY + ["--data-path", str(text), "--split", "9,1", "--train-iters", "1"]))
    with pytest.raises(ValueError, match="split: expected one to three non-negative numbers"):
        pretrain_gpt.parse_args(TINY + ["--split", "9,x"])


def _masked_losses(micro_batch_size: int) -> list[float]:
    model = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                              moe_router_topk=2, moe_ffn_hidden_size=16, ffn_hidden_size=32, seq_length=8)
    state = setup_training(model, TrainingConfig(micro_batch_size=micro_batch_size, global_batch_size=4,
                                                 eod_mask_loss=True, lr=1e-2))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        inputs, labels = torch.randint(0, 256, (2, 4, 8), generator=gen)
        labels[:3] = -100  # the first micro-batch of two rows counts 5 labels, the other 16
        labels[3, :5] = -100
        with torch.no_grad():
            expected = state.model(inputs, labels).double().sum() / (labels != -100).sum()
        loss, _, _ = train_step(state, inputs, labels)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)
        losses.append(loss.item())
    return losses


def test_masked_loss_is_the_mean_over_the_labels_that_count():
    """With eod_mask_loss the step's loss is the global batch's mean over unmasked labels, the same whatever
    the micro-batches: 2 micro-batches of 2 rows (5 and 16 labels) train as one of 4."""
    torch.testing.assert_close(torch.tensor(_masked_losses(2)), torch.tensor(_masked_losses(4)), rtol=1e-5, atol=0)
