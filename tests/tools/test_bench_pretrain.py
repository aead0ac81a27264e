"""tools/bench_pretrain.py: its plain-PyTorch GPT computes moe_core's function (float64, CPU) and trains the same
trajectory, the GPU configs have the sizes they claim, and --smoke writes complete rows."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_pretrain as bench  # noqa: E402
from _native_gpt import NativeGPT  # noqa: E402

from moe_core import TransformerConfig  # noqa: E402
from moe_core.models.gpt import GPTModel  # noqa: E402
from moe_core.training.config import TrainingConfig  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_native_gpt_equals_moe_core_gpt_in_float64():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                               moe_router_topk=2, moe_ffn_hidden_size=16, seq_length=12, moe_router_dtype="fp64",
                               init_method_std=0.2)
    gpt = GPTModel(config).double()
    native = NativeGPT.from_gpt(gpt)
    assert native.embedding.weight.data_ptr() != gpt.embedding.weight.data_ptr()  # copies: they train apart
    assert sum(p.numel() for p in native.parameters()) == gpt.num_parameters()
    ids = torch.randint(0, config.vocab_size, (3, config.seq_length))
    labels = torch.randint(0, config.vocab_size, (3, config.seq_length))
    hidden, expected = native.hidden(ids), gpt.decoder(gpt.embedding(ids))
    torch.testing.assert_close(hidden, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(expected)
    (grad,) = torch.autograd.grad((hidden * weights).sum(), native.embedding.weight)
    (grad_expected,) = torch.autograd.grad((expected * weights).sum(), gpt.embedding.weight)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-12, atol=1e-12)
    # Both upcast the logits to float32 (GPTModel: float64 in, float32 out): float32's tolerance.
    torch.testing.assert_close(native(ids, labels), gpt(ids, labels).mean())


def test_native_gpt_refuses_what_it_does_not_compute():
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0])
    with pytest.raises(ValueError, match=r"num_query_groups.*moe_layer_freq"):
        NativeGPT.from_gpt(GPTModel(config))


@pytest.mark.parametrize("name, total, active, layers", [("gpu_a", 839_926_784, 135_283_712, 8),
                                                          ("gpu_b", 1_679_312_896, 270_026_752, 4)])
def test_gpu_configs_have_their_sizes(name, total, active, layers):
    path = CONFIGS / f"{name}.yaml"
    config, training = TransformerConfig.from_yaml(path), TrainingConfig.from_yaml(path)
    counts = bench.flop_counts(config)
    assert (counts["params"], counts["active_params"]) == (total, active)
    assert all(config.is_moe_layer(i) for i in range(config.num_layers)) and config.num_layers == layers
    assert training.bf16 and training.compile and config.moe_aux_loss_coeff == 0.0
    attention = 12 * config.num_layers * config.hidden_size * config.seq_length  # 12 L Nq D S, MHA: Nq D = H
    assert counts["flops_per_token"] - counts["flops_per_token_causal"] == attention / 2
    assert counts["flops_per_token"] == 6 * (active - config.vocab_size * config.hidden_size) + attention


def test_smoke_writes_a_row_per_provider_and_both_trainers_follow_one_trajectory(tmp_path):
    out = tmp_path / "rows.json"
    bench.main(["--smoke", "--profile", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu"
    rows = {r["provider"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(bench.SMOKE_PROVIDERS)
    for provider, row in rows.items():
        assert "error" not in row, row.get("error")
        for key in ("median_ms", "min_ms", "max_ms", "spread", "tokens_per_s", "first_loss", "last_loss",
                    "flops_per_token", "flops_per_token_causal", "flops_per_token_megatron",
                    "megatron_tflops_per_gpu"):
            assert math.isfinite(row[key]) and row[key] >= 0, (provider, key, row[key])
        assert row["tokens_per_step"] == 2 * 16 and row["mfu"] is None and row["mfu_causal"] is None  # CPU: no MFU
        assert row["last_loss"] < row["first_loss"]  # it trains
        profile = row["profile"]
        assert set(profile["ms_per_step"]) == {"attention", "gemm", "optimizer", "rest"}
        assert profile["ms_per_step"]["gemm"] > 0 and profile["ms_per_step"]["optimizer"] > 0
        assert len(profile["top"]) == 10
    # Same weights, batch, constant LR and AdamW hyperparameters: the same losses up to float32 rounding (AdamW's
    # betas (0.9, 0.999) for (0.9, 0.95), eps 1e-6 for 1e-8 or no weight decay move the last loss by 1e-5 to 6e-5).
    assert rows["native"]["first_loss"] == pytest.approx(rows["moe_core"]["first_loss"], rel=1e-6)
    assert rows["native"]["last_loss"] == pytest.approx(rows["moe_core"]["last_loss"], rel=1e-6)


@pytest.mark.gpu
def test_cuda_smoke_reports_mfu_memory_and_a_profile():
    rows = {r["provider"]: r for r in bench.main(["--smoke", "--profile"])}
    for provider, row in rows.items():
        assert "error" not in row, (provider, row.get("error"))
        assert 0 < row["mfu_causal"] < row["mfu"] < 1 and row["peak_gib"] > 0
        assert all(row["profile"]["ms_per_step"][k] > 0 for k in ("gemm", "optimizer", "rest"))
    # bf16 autocast: the two trainers' losses differ by rounding only.
    assert rows["native"]["first_loss"] == pytest.approx(rows["moe_core"]["first_loss"], rel=1e-2)
