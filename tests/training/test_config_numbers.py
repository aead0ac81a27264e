"""Every float of both configs rejects NaN and Inf, every coefficient its out-of-range values, from Python,
YAML and the command line; YAML reads 3e-3 as a number."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from moe_core.config import TransformerConfig
from moe_core.training.config import TrainingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import pretrain_gpt  # noqa: E402

MOE = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2)


def _float_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if "float" in str(f.type)]


def test_every_float_field_is_covered():
    assert _float_fields(TransformerConfig) == [
        "layernorm_epsilon", "rotary_base", "init_method_std", "moe_router_topk_scaling_factor",
        "moe_router_bias_update_rate", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps",
        "moe_expert_capacity_factor"]
    assert _float_fields(TrainingConfig) == [
        "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
        "distributed_timeout_minutes"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", _float_fields(TransformerConfig))
@pytest.mark.parametrize("experts", [4, None], ids=["moe", "dense"])
def test_transformer_config_rejects_non_finite(name, value, experts):
    with pytest.raises(ValueError, match=rf"^{name}: expected a finite number.*, got -?(nan|inf)$"):
        TransformerConfig(**{**MOE, "num_moe_experts": experts, name: value})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", _float_fields(TrainingConfig))
def test_training_config_rejects_non_finite(name, value):
    with pytest.raises(ValueError, match=rf"^{name}: expected a finite number.*, got -?(nan|inf)$"):
        TrainingConfig(**{name: value})


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_aux_loss_coeff=-0.01), r"moe_aux_loss_coeff: expected a finite number >= 0, got -0.01"),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, -1.0]),
     r"moe_aux_loss_coeff\[1\]: expected a finite number >= 0"),
    (dict(moe_z_loss_coeff=-1e-3), r"moe_z_loss_coeff: expected a finite number >= 0"),
    (dict(moe_input_jitter_eps=1.0), r"moe_input_jitter_eps: expected a finite number >= 0 and < 1, got 1.0"),
    (dict(moe_input_jitter_eps=-0.1), r"moe_input_jitter_eps: expected a finite number >= 0 and < 1"),
    (dict(moe_expert_capacity_factor=0.0), r"moe_expert_capacity_factor: expected a finite number > 0"),
    (dict(moe_router_topk_scaling_factor=-2.5), r"moe_router_topk_scaling_factor: expected a finite number > 0"),
    (dict(moe_router_bias_update_rate=-1e-3), r"moe_router_bias_update_rate: expected a finite number >= 0"),
    (dict(layernorm_epsilon=0.0), r"layernorm_epsilon: expected a finite number > 0"),
    (dict(moe_z_loss_coeff="1e-3"), r"moe_z_loss_coeff: expected a number or None, got str \('1e-3'\)"),
    (dict(moe_aux_loss_coeff=True), r"moe_aux_loss_coeff: expected a number or a list of numbers, got bool"),
])
def test_transformer_config_ranges(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TransformerConfig(**{**MOE, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(adam_beta1=1.0), r"adam_beta1: expected a finite number >= 0 and < 1, got 1.0"),
    (dict(adam_beta2=-0.1), r"adam_beta2: expected a finite number >= 0 and < 1"),
    (dict(adam_eps=0.0), r"adam_eps: expected a finite number > 0"),
    (dict(lr=0.0), r"lr: expected a finite number > 0"),
    (dict(clip_grad=-1.0), r"clip_grad: expected a finite number >= 0"),
    (dict(weight_decay=-0.1), r"weight_decay: expected a finite number >= 0"),
    (dict(distributed_timeout_minutes=0), r"distributed_timeout_minutes: expected a finite number > 0"),
    (dict(lr="3e-3"), r"lr: expected a number, got str \('3e-3'\)"),
    (dict(max_skipped_steps=-1), r"max_skipped_steps: expected an int >= 0"),
    (dict(save_keep=0), r"save_keep: expected an int >= 1"),
    (dict(enable_cuda_graph=True), r"enable_cuda_graph: needs compile and no use_torch_fsdp2 .*, got compile=False, "
                                   r"use_torch_fsdp2=False"),
    (dict(enable_cuda_graph=True, compile=True, use_torch_fsdp2=True),
     r"enable_cuda_graph: .*, got compile=True, use_torch_fsdp2=True"),
])
def test_training_config_ranges(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TrainingConfig(**overrides)


def test_yaml_reads_exponents_as_numbers(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  num_layers: 1\n  hidden_size: 16\n  num_attention_heads: 2\n  num_moe_experts: 4\n"
                      "  moe_z_loss_coeff: 1E-3\ntraining:\n  lr: 3e-3\n  min_lr: 3.0e-4\n  adam_eps: 1e-8\n")
    model, training = pretrain_gpt.parse_args(["--config", str(config)])
    assert (training.lr, training.min_lr, training.adam_eps, model.moe_z_loss_coeff) == (3e-3, 3e-4, 1e-8, 1e-3)
    config.write_text("model:\n  num_layers: 1\n  hidden_size: 16\n  num_attention_heads: 2\ntraining:\n  lr: .nan\n")
    with pytest.raises(ValueError, match="lr: expected a finite number > 0, got nan"):
        pretrain_gpt.parse_args(["--config", str(config)])


@pytest.mark.parametrize("flag, value, name", [("--clip-grad", "nan", "clip_grad"), ("--lr", "inf", "lr"),
                                                ("--moe-aux-loss-coeff", "-1", "moe_aux_loss_coeff"),
                                                ("--moe-input-jitter-eps", "1.5", "moe_input_jitter_eps")])
def test_command_line_rejects_bad_floats(flag, value, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected a finite number"):
        pretrain_gpt.parse_args([flag, value])


@pytest.mark.parametrize("flag, name", [("--train-iters", "train_iters"), ("--micro-batch-size", "micro_batch_size"),
                                        ("--seed", "seed"), ("--num-experts", "num_moe_experts"),
                                        ("--seq-length", "seq_length")])
def test_counts_beyond_int64_name_the_argument(flag, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected .*<= 2\*\*63 - 1, got 99999999999999999999$"):
        pretrain_gpt.parse_args([flag, "99999999999999999999"])
    assert TrainingConfig(train_iters=2**63 - 1, seed=2**63 - 1).train_iters == 2**63 - 1
