"""The pretraining script end to end on a tiny model and corpus: outputs, resume, accumulation, flags, LR."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from moe_core.training.checkpoint import load_checkpoint, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.schedule import build_scheduler, lr_at
from moe_core.training.trainer import mfu, pretrain

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import pretrain_gpt  # noqa: E402

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--seq-length", "16", "--micro-batch-size", "4",
        "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "2",
        "--eval-interval", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]


@pytest.fixture
def corpus(tmp_path):
    files = []
    for i in range(40):
        path = tmp_path / "corpus" / f"doc{i}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
        files.append(str(path))
    return files


def run(tmp_path, corpus, name, *extra):
    """Parse flags as the script does, train, return (summary, output dir, printed lines)."""
    out = tmp_path / name
    model, training = pretrain_gpt.parse_args(TINY + ["--data-path", *corpus, "--output-dir", str(out), *extra])
    printed = []
    return pretrain(model, training, log=printed.append), out, printed


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_smoke_writes_metrics_tensorboard_png_and_checkpoint(tmp_path, corpus, capsys):
    """The script's main() as the command line runs it, 4 steps."""
    out = tmp_path / "smoke"
    pretrain_gpt.main(TINY + ["--data-path", *corpus, "--output-dir", str(out), "--train-iters", "4",
                              "--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb")])
    printed = re.search(r"^validation loss: start (\d+\.\d{3}), end (\d+\.\d{3}) nats per byte$",
                        capsys.readouterr().out, re.MULTILINE)
    assert printed, "the run must print its validation losses"
    start, end = float(printed[1]), float(printed[2])
    assert start == pytest.approx(math.log(256), abs=0.3) and end < start
    lines = rows(out)
    train_lines = [row for row in lines if "loss" in row]
    assert [row["step"] for row in train_lines] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", "tokens_per_second", "aux_loss", "z_loss", "expert_load_min",
                "expert_load_max", "expert_load_cv"):
        assert all(math.isfinite(row[key]) for row in train_lines), key
    # Each routed row lands on one expert: 4 x 16 tokens, top-2, 4 experts -> loads around 32 per expert.
    assert all(0 <= row["expert_load_min"] <= 32 <= row["expert_load_max"] <= 128 for row in train_lines)
    # Per MoE layer: summary scalars, the dead experts and the expert loads of the logged step.
    for row in train_lines:
        assert row["dead_experts"] == sum(layer["dead_experts"] for layer in row["moe"].values())
        assert all(sum(layer["tokens_per_expert"]) == 128 for layer in row["moe"].values())
    assert [row["lr"] for row in train_lines] == pytest.approx([lr_at(s, 1e-2, 1e-3, 1, 4) for s in (1, 2, 3, 4)])
    valid = {row["step"]: row["valid_loss"] for row in lines if "valid_loss" in row}
    assert list(valid) == [0, 2, 4] and f"{valid[0]:.3f}" == printed[1] and f"{valid[4]:.3f}" == printed[2]
    # MFU only where the run's device has a known bf16 peak (a CUDA device), never on the CPU.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert ("mfu" in train_lines[0]) == (mfu(1.0, 1.0, device) is not None)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_4\n"
    assert {p.name for p in (tmp_path / "ckpt" / "step_4").iterdir()} >= {".metadata", "state.json", "manifest.json"}


def test_resume_gives_the_same_losses(tmp_path, corpus):
    """2N steps straight == N steps, save, load, N more: same float32 losses at every step on CPU, under a
    warmup + cosine schedule over the whole run and router input jitter (so the RNG state must resume too)."""
    flags = ["--train-iters", "6", "--moe-input-jitter-eps", "0.1", "--lr-warmup-iters", "2"]
    straight, straight_out, _ = run(tmp_path, corpus, "straight", *flags)
    first, out, _ = run(tmp_path, corpus, "resumed", *flags, "--exit-interval", "3", "--save", str(tmp_path / "ckpt"))
    assert len(first.train_losses) == 3
    resumed, out, _ = run(tmp_path, corpus, "resumed", *flags, "--load", str(tmp_path / "ckpt"))
    assert first.train_losses + resumed.train_losses == straight.train_losses
    assert resumed.start_valid_loss == first.end_valid_loss
    assert resumed.end_valid_loss == straight.end_valid_loss
    assert len(set(straight.train_losses)) == 6
    # The resumed run's metrics continue the first half's: the straight run's rows, plus one validation row
    # at the checkpoint's step (the resume evaluates there once; the first half's row was replaced).
    def trajectory(directory):
        return [(r["step"], r.get("loss"), r.get("valid_loss"), r.get("lr")) for r in rows(directory)]

    resumed_rows = trajectory(out)
    assert resumed_rows.count((3, None, resumed.start_valid_loss, None)) == 1
    resumed_rows.remove((3, None, resumed.start_valid_loss, None))
    assert resumed_rows == trajectory(straight_out)
    with pytest.raises(ValueError, match=r"train_iters \(2\) is below the step of the checkpoint"):
        run(tmp_path, corpus, "too_short", *flags[2:], "--train-iters", "2", "--load", str(tmp_path / "ckpt"))


def test_checkpoint_restores_rng_and_checks_the_seed(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, 1.0, 0.0, 0, 10)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    save_checkpoint(str(tmp_path / "c"), model, optimizer, scheduler, 1, seed=7)
    after_save = torch.rand(5)
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    assert load_checkpoint(str(tmp_path / "c"), model, optimizer, scheduler, seed=7) == 1
    assert torch.equal(torch.rand(5), after_save)
    assert torch.equal(model.weight, weight)
    assert scheduler.last_epoch == 1
    with pytest.raises(ValueError, match="seed: .* seed 7, got 8"):
        load_checkpoint(str(tmp_path / "c"), model, optimizer, scheduler, seed=8)


def test_gradient_accumulation_matches_one_micro_batch(tmp_path, corpus):
    """--global-batch-size 4 with --micro-batch-size 2 (2 accumulated micro-batches) trains like micro 4.

    The Switch aux loss is a function of each micro-batch's loads (not a sum over tokens), so accumulation
    changes it by design: it is off here; the z-loss (a per-token mean) stays on."""
    whole, _, _ = run(tmp_path, corpus, "whole", "--train-iters", "3", "--moe-aux-loss-coeff", "0")
    accumulated, _, _ = run(tmp_path, corpus, "accumulated", "--train-iters", "3", "--micro-batch-size", "2",
                            "--global-batch-size", "4", "--moe-aux-loss-coeff", "0")
    torch.testing.assert_close(torch.tensor(accumulated.train_losses), torch.tensor(whole.train_losses),
                               rtol=1e-5, atol=0)


def test_hf_tokenizer_run(tmp_path, corpus):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train(corpus, trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    model, training = pretrain_gpt.parse_args(TINY + ["--tokenizer", str(tmp_path / "tokenizer.json")])
    assert model.vocab_size == tok.get_vocab_size()
    summary, _, printed = run(tmp_path, corpus, "hf", "--train-iters", "1",
                              "--tokenizer", str(tmp_path / "tokenizer.json"))
    assert summary.start_valid_loss == pytest.approx(math.log(model.vocab_size), abs=0.3)
    assert any(line.endswith("nats per token") for line in printed)


def test_flags_override_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  num_layers: 3\n  hidden_size: 16\n  num_attention_heads: 2\n  num_moe_experts: 8\n"
                      "training:\n  train_iters: 7\n  lr: 0.5\n  micro_batch_size: 8\n")
    model, training = pretrain_gpt.parse_args(["--config", str(config), "--num-layers", "2", "--lr", "0.1",
                                               "--num-experts", "4", "--moe-router-topk", "1",
                                               "--tensorboard-dir", "tb", "--exit-interval", "5"])
    assert (model.num_layers, model.hidden_size, model.num_moe_experts, model.moe_router_topk) == (2, 16, 4, 1)
    assert (training.train_iters, training.lr, training.micro_batch_size) == (7, 0.1, 8)
    assert (training.tensorboard_dir, training.exit_interval) == ("tb", 5)
    with pytest.raises(ValueError, match="unknown TrainingConfig fields: \\['nonsense'\\]"):
        config.write_text("model:\n  num_layers: 1\n  hidden_size: 16\n  num_attention_heads: 2\n"
                          "training:\n  nonsense: 1\n")
        pretrain_gpt.parse_args(["--config", str(config)])


def test_parallel_flags_use_megatrons_names():
    model, _ = pretrain_gpt.parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
                                        "--cross-entropy-chunk-size", "64"])
    assert (model.tensor_model_parallel_size, model.sequence_parallel, model.expert_tensor_parallel_size,
            model.expert_model_parallel_size, model.cross_entropy_chunk_size) == (2, True, 1, 2, 64)
    assert pretrain_gpt.parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel"])[0] \
        .expert_tensor_parallel_size == 2  # Megatron's default: ETP = TP
    with pytest.raises(ValueError, match="sequence_parallel: tensor_model_parallel_size 2 requires"):
        pretrain_gpt.parse_args(["--tensor-model-parallel-size", "2"])


def test_tiny_yaml_is_the_default_run():
    model, training = pretrain_gpt.parse_args([])
    assert (model.num_layers, model.hidden_size, model.num_moe_experts, model.moe_router_topk, model.seq_length) \
        == (4, 128, 8, 2, 128)
    assert training.micro_batch_size == 32 and training.data_path is None and training.tokenizer is None


def test_lr_schedule_warmup_and_cosine():
    assert lr_at(0, 1.0, 0.1, 4, 20) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 0.1, 4, 20) == pytest.approx(1.0)
    assert lr_at(4, 1.0, 0.1, 4, 20) == pytest.approx(1.0)
    assert lr_at(12, 1.0, 0.1, 4, 20) == pytest.approx(0.55)  # half way through the decay
    assert lr_at(20, 1.0, 0.1, 4, 20) == pytest.approx(0.1)
    assert lr_at(25, 1.0, 0.1, 4, 20) == pytest.approx(0.1)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, 1.0, 0.1, 4, 20)
    seen = []
    for _ in range(20):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(s, 1.0, 0.1, 4, 20) for s in range(20)])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_training_config_validation():
    with pytest.raises(ValueError, match="lr_warmup_iters"):
        TrainingConfig(train_iters=5, lr_warmup_iters=6)
    with pytest.raises(TypeError, match="micro_batch_size: expected an int, got float"):
        TrainingConfig(micro_batch_size=4.0)
    with pytest.raises(ValueError, match="exit_interval"):
        TrainingConfig(exit_interval=0)
    with pytest.raises(ValueError, match="min_lr"):
        TrainingConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainingConfig(micro_batch_size=4, global_batch_size=6).num_micro_batches(dp_size=1)
    assert TrainingConfig(micro_batch_size=4, global_batch_size=16).num_micro_batches(dp_size=2) == 2


@pytest.mark.parametrize("name, peak_tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                               ("NVIDIA H200", 989.0), ("Some Other GPU", None)])
def test_mfu_uses_the_peak_of_the_device(monkeypatch, name, peak_tflops):
    from moe_core.training import trainer

    monkeypatch.setattr(trainer.torch.cuda, "get_device_name", lambda device: name)
    got = trainer.mfu(flops_per_token=2e9, tokens_per_second=1e5, device=torch.device("cuda", 0))
    assert got == (None if peak_tflops is None else pytest.approx(2e14 / (peak_tflops * 1e12)))
    assert trainer.mfu(2e9, 1e5, torch.device("cpu")) is None


def test_a_configuration_error_exits_with_its_message_alone():
    with pytest.raises(SystemExit, match=r"^pretrain_gpt.py: error: num_layers: expected a positive int"):
        pretrain_gpt.main(["--num-layers", "0"])
