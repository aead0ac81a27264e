"""Architecture configs on the meta device: total and active parameter counts against the published figures and,
for the three Hugging Face architectures, exactly against transformers' own model; DeepSeek-V3's MoE part
exactly; the aux-loss coefficients converted from HF's; config validation."""

from pathlib import Path

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.interop.hf_config import aux_loss_coeff_from_hf, config_to_hf
from moe_core.models.gpt import GPTModel
from moe_core.moe.moe_layer import MoELayer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PUBLISHED = {  # (total, active) from each model's paper / model card
    "qwen3_30b_a3b": (30.5e9, 3.3e9),
    "mixtral_8x7b": (46.7e9, 12.9e9),
    "olmoe_1b_7b": (6.9e9, 1.3e9),
}


def build(name: str) -> GPTModel:
    with torch.device("meta"):
        return GPTModel(TransformerConfig.from_yaml(CONFIGS / f"{name}.yaml"))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    model = build(name)
    total, active = PUBLISHED[name]
    assert model.num_parameters() == pytest.approx(total, rel=0.02)
    assert model.num_parameters(active=True) == pytest.approx(active, rel=0.02)

HF_AUX_LOSS_COEF = {"qwen3_30b_a3b": 0.001, "mixtral_8x7b": 0.02, "olmoe_1b_7b": 0.01}  # each config.json's


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_equals_transformers(name):
    """transformers builds the same architecture from the YAML (through the export mapping) with exactly as many
    parameters: OLMoE's full-width QK-norm included."""
    from transformers import AutoModelForCausalLM

    model = build(name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config_to_hf(model.config))
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_aux_loss_coeff_is_hf_coefficient_converted(name):
    cfg = build(name).config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert cfg.moe_aux_loss_coeff == aux_loss_coeff_from_hf(HF_AUX_LOSS_COEF[name], cfg.moe_router_topk, moe_layers)


def test_parameter_counts_are_computed_on_meta():
    model = build("olmoe_1b_7b")
    assert all(p.is_meta for p in model.parameters())
    cfg = model.config
    assert (cfg.moe_router_pre_softmax, cfg.qk_layernorm, cfg.num_query_groups) == (True, True, 16)
    assert cfg.qk_layernorm_span == "projection"


def test_deepseek_v3_moe_part_is_exact():
    model = build("deepseek_v3")
    cfg = model.config
    kinds = ["moe" if isinstance(layer.mlp, MoELayer) else "dense" for layer in model.decoder.layers]
    assert kinds == ["dense"] * 3 + ["moe"] * 58
    assert model.decoder.layers[0].mlp.linear_fc2.weight.shape == (7168, 18432)
    moe = model.moe_layers()[0]
    assert sum(p.numel() for p in moe.experts.parameters()) == 256 * 3 * 7168 * 2048
    assert sum(p.numel() for p in moe.shared_experts.parameters()) == 3 * 7168 * 2048
    assert moe.router.weight.shape == (256, 7168) and moe.router.expert_bias.shape == (256,)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk) == (8, 4, 8)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_topk_scaling_factor == 2.5
    # The count the YAML documents (MHA attention in place of MLA).
    assert model.num_parameters() == 688_268_342_272
    assert model.num_parameters(active=True) == 54_794_220_544


def test_deepseek_v3_with_mla_attention_counts_the_published_figures():
    """Swapping each layer's attention count for MLA's (config.json dims) must give the published 671B / 37B:
    everything but attention is then accounted for."""
    model = build("deepseek_v3")
    hidden, heads = 7168, 128
    q_lora, kv_lora, nope, rope, v_dim = 1536, 512, 128, 64, 128
    mla = (hidden * q_lora + q_lora + q_lora * heads * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
           + hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)  # kv_a, its norm, kv_b
           + heads * v_dim * hidden)  # o_proj
    ours = sum(p.numel() for p in model.decoder.layers[0].self_attention.parameters())
    difference = 61 * (ours - mla)
    assert model.num_parameters() - difference == pytest.approx(671e9, rel=0.002)
    assert model.num_parameters(active=True) - difference == pytest.approx(37e9, rel=0.02)


def test_tiny_config_loads():
    cfg = TransformerConfig.from_yaml(CONFIGS / "tiny.yaml")
    assert cfg.num_moe_experts == 8 and cfg.moe_router_topk == 2


@pytest.mark.parametrize("overrides,error,message", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_layers=2.5), TypeError, "num_layers"),
    (dict(num_query_groups=3), ValueError, "num_query_groups"),
    (dict(hidden_size=18), ValueError, "num_attention_heads"),
    (dict(kv_channels=5), ValueError, "kv_channels"),
    (dict(layernorm_epsilon=0.0), ValueError, "layernorm_epsilon"),
    (dict(num_moe_experts=4, first_k_dense_replace=3), ValueError, "first_k_dense_replace"),
    (dict(num_moe_experts=4, moe_router_score_function="relu"), ValueError, "moe_router_score_function"),
    (dict(num_moe_experts=4, moe_router_score_function="sigmoid", moe_router_pre_softmax=True), ValueError,
     "moe_router_pre_softmax"),
    (dict(activation_func="tanh"), ValueError, "activation_func"),
    (dict(qk_layernorm=True, qk_layernorm_span="group"), ValueError, "qk_layernorm_span"),
    (dict(num_moe_experts=4, moe_router_topk=5), ValueError, "moe_router_topk"),
    (dict(num_moe_experts=6, moe_router_num_groups=4, moe_router_group_topk=1), ValueError, "moe_router_num_groups"),
    (dict(num_moe_experts=4, moe_router_num_groups=2), ValueError, "moe_router_group_topk"),
    (dict(num_moe_experts=4, moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=0.1), ValueError,
     "moe_aux_loss_coeff"),
    (dict(num_moe_experts=4, moe_router_load_balancing_type="switch"), ValueError, "moe_router_load_balancing_type"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4), ValueError, "expert_model_parallel_size"),
    (dict(num_moe_experts=4, moe_pad_expert_input_to_capacity=True), ValueError, "moe_expert_capacity_factor"),
    (dict(num_moe_experts=4, moe_shared_expert_overlap=True), ValueError, "moe_shared_expert_intermediate_size"),
    (dict(num_moe_experts=4, moe_layer_freq=[1, 0, 1]), ValueError, "moe_layer_freq"),
    (dict(num_moe_experts=4, moe_token_dispatcher_type="allgather", moe_dispatch_sync_free=True), ValueError,
     r"^moe_dispatch_sync_free: only the all-to-all dispatcher .* 'allgather' it would do nothing$"),
    (dict(tensor_model_parallel_size=0), ValueError, "tensor_model_parallel_size"),
    (dict(tensor_model_parallel_size=2), ValueError, r"sequence_parallel: tensor_model_parallel_size 2 requires"),
    (dict(tensor_model_parallel_size=4, sequence_parallel=True, num_query_groups=2), ValueError,
     r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, vocab_size=31), ValueError, r"vocab_size \(31\)"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, seq_length=9), ValueError, r"seq_length \(9\)"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, qk_layernorm=True, qk_layernorm_span="projection"),
     ValueError, "qk_layernorm_span"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=4), ValueError,
     r"expert_tensor_parallel_size: expected 1 or tensor_model_parallel_size \(2\), got 4"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, num_moe_experts=4, moe_ffn_hidden_size=3),
     ValueError, r"moe_ffn_hidden_size \(3\) must be divisible by expert_tensor_parallel_size \(2\)"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, num_moe_experts=4, add_bias_linear=True),
     ValueError, "add_bias_linear"),
    (dict(sequence_parallel=1), TypeError, "sequence_parallel"),
    (dict(cross_entropy_chunk_size=0), ValueError, "cross_entropy_chunk_size"),
])
def test_config_validation_names_the_field(overrides, error, message):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4)
    with pytest.raises(error, match=message):
        TransformerConfig(**{**base, **overrides})


def test_tensor_parallel_sizes():
    """ETP defaults to TP (Megatron); ETP 1 is allowed; single_process() clears every parallel size."""
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_moe_experts=4, sequence_parallel=True)
    assert TransformerConfig(**base, tensor_model_parallel_size=2).expert_tensor_parallel_size == 2
    cfg = TransformerConfig(**base, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                            expert_model_parallel_size=2)
    assert cfg.expert_tensor_parallel_size == 1
    single = cfg.single_process()
    assert (single.tensor_model_parallel_size, single.expert_tensor_parallel_size, single.expert_model_parallel_size,
            single.sequence_parallel) == (1, 1, 1, False)


def test_unknown_yaml_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layers: 1\n  hidden_size: 8\n  num_attention_heads: 2\n  num_experts: 4\n")
    with pytest.raises(ValueError, match="num_experts"):
        TransformerConfig.from_yaml(path)


def test_missing_required_fields_are_named_with_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  num_layers: 2\n")
    with pytest.raises(ValueError, match=r"m.yaml: model: TransformerConfig: missing required fields "
                                         r"\['hidden_size', 'num_attention_heads'\]"):
        TransformerConfig.from_yaml(path)
