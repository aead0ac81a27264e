"""The pretraining script end to end on a tiny model and corpus: outputs, resume, flags, LR schedule."""

import json
import math
from pathlib import Path

import pytest

from moe_core.training.config import TrainingConfig
from moe_core.training.schedule import lr_at

ROOT = Path(__file__).resolve().parents[2]
import sys  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import pretrain_gpt  # noqa: E402

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--seq-length", "16", "--micro-batch-size", "4",
        "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "2"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("def f(x):\n    return x * 2\n" * 200)
    files = [path]
    for i in range(40):
        extra = tmp_path / f"doc{i}.txt"
        extra.write_text(f"# document {i}\nprint({i})\n" * 10)
        files.append(extra)
    return [str(f) for f in files]


def run(tmp_path, corpus, name, *extra):
    out = tmp_path / name
    model, training = pretrain_gpt.parse_args(TINY + ["--data-path", *corpus, "--output-dir", str(out), *extra])
    from moe_core.training.trainer import pretrain

    return pretrain(model, training, log=lambda *_: None), out


def test_smoke_writes_metrics_tensorboard_png_and_checkpoint(tmp_path, corpus):
    summary, out = run(tmp_path, corpus, "smoke", "--train-iters", "4", "--save", str(tmp_path / "ckpt"))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [row for row in lines if "loss" in row]
    assert [row["step"] for row in train_lines] == [1, 2, 3, 4]
    for key in ("grad_norm", "lr", "tokens_per_second", "aux_loss", "expert_load_min", "expert_load_max", "expert_load_cv"):
        assert all(math.isfinite(row[key]) for row in train_lines), key
    assert [row["step"] for row in lines if "valid_loss" in row] == [0, 2, 4]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "ckpt" / ".metadata").exists()
    assert summary.start_valid_loss > summary.end_valid_loss


def test_resume_gives_the_same_losses(tmp_path, corpus):
    # A constant LR makes the schedule independent of --train-iters, so a 3-step run is the first half of a
    # 6-step run.
    constant_lr = ["--min-lr", "1e-2", "--lr-warmup-iters", "0"]
    straight, _ = run(tmp_path, corpus, "straight", "--train-iters", "6", *constant_lr)
    run(tmp_path, corpus, "first", "--train-iters", "3", "--save", str(tmp_path / "ckpt"), *constant_lr)
    resumed, _ = run(tmp_path, corpus, "resumed", "--train-iters", "6", "--load", str(tmp_path / "ckpt"), *constant_lr)
    assert len(resumed.train_losses) == 3
    assert resumed.train_losses == straight.train_losses[3:]
    assert straight.train_losses[3] != straight.train_losses[0]


def test_flags_override_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  num_layers: 3\n  hidden_size: 16\n  num_attention_heads: 2\n"
                      "training:\n  train_iters: 7\n  lr: 0.5\n")
    model, training = pretrain_gpt.parse_args(["--config", str(config), "--num-layers", "2", "--lr", "0.1",
                                               "--num-experts", "4"])
    assert (model.num_layers, model.hidden_size, model.num_moe_experts) == (2, 16, 4)
    assert (training.train_iters, training.lr) == (7, 0.1)


def test_lr_schedule_warmup_and_cosine():
    assert lr_at(0, 1.0, 0.1, 4, 20) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 0.1, 4, 20) == pytest.approx(1.0)
    assert lr_at(4, 1.0, 0.1, 4, 20) == pytest.approx(1.0)
    assert lr_at(12, 1.0, 0.1, 4, 20) == pytest.approx(0.55)
    assert lr_at(20, 1.0, 0.1, 4, 20) == pytest.approx(0.1)


def test_training_config_validation():
    with pytest.raises(ValueError, match="lr_warmup_iters"):
        TrainingConfig(train_iters=5, lr_warmup_iters=6)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainingConfig(micro_batch_size=4, global_batch_size=6).num_micro_batches(dp_size=1)
    assert TrainingConfig(micro_batch_size=4, global_batch_size=16).num_micro_batches(dp_size=2) == 2
