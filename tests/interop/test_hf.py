"""Hugging Face import and export against transformers itself, on tiny random models built here from config
objects (nothing is downloaded): logits parity in float32, RoPE at long positions, bitwise round trips through
``save_hf`` and ``from_pretrained``, the aux loss of one batch after the documented conversion, and a wrong
mapping (fc1 halves swapped) as the negative control."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from moe_core.interop import hf_weights
from moe_core.interop.hf import load_hf, save_hf
from moe_core.interop.hf_config import aux_loss_coeff_from_hf, config_from_hf
from moe_core.models.gpt import GPTModel
from moe_core.models.rope import rope_cos_sin
from moe_core.moe.load_balancing import routing_scores_for_aux_loss, switch_load_balancing_loss
from tests.interop._common import CASES, TINY, build_hf


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """An HF model saved in shards (index file), and moe_core's load of it."""
    hf = build_hf(CASES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    config, model = load_hf(path)
    return dataclasses.make_dataclass("Case", ["name", "hf", "path", "config", "model"])(
        request.param, hf, path, config, model.eval())


def max_logit_error(case_, ids: torch.Tensor, model: GPTModel | None = None) -> float:
    with torch.no_grad():
        expected = case_.hf(ids).logits
        actual = (model or case_.model)(ids)
    assert expected.abs().max() > 1.0  # a parity that means something
    return (actual - expected).abs().max().item()


def ids_for(case_, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, case_.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))


def test_load_hf_logits_match_transformers(case):
    assert max_logit_error(case, ids_for(case)) <= 1e-5


@pytest.mark.parametrize("name", ["qwen3-gqa-hd16-e8k2", "mixtral-gqa-hd16-e8k2", "olmoe-gqa-e16k4"])
def test_swapped_fc1_halves_fail_parity(name, tmp_path, monkeypatch):
    """Negative control: a mapping that puts up before gate loads without error and must fail the parity."""
    hf = build_hf(CASES[name]())
    hf.save_pretrained(tmp_path)
    block, gate, up, down = hf_weights.EXPERT_NAMES[hf.config.model_type]
    monkeypatch.setitem(hf_weights.EXPERT_NAMES, hf.config.model_type, (block, up, gate, down))
    config, wrong = load_hf(tmp_path)
    case_ = dataclasses.make_dataclass("Case", ["hf", "model", "config"])(hf, wrong.eval(), config)
    assert max_logit_error(case_, ids_for(case_)) > 1e-2


def test_save_hf_round_trips_every_tensor_bitwise(case, tmp_path):
    out = save_hf(case.model, case.config, tmp_path / "export", max_shard_size="16KiB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    expected, actual = case.hf.state_dict(), reloaded.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
    assert reloaded.config.router_aux_loss_coef == pytest.approx(case.hf.config.router_aux_loss_coef, rel=1e-12)
    config_again, _ = load_hf(out)
    assert config_again == dataclasses.replace(case.config, moe_aux_loss_coeff=config_again.moe_aux_loss_coeff)


def test_load_hf_buffers_equal_a_fresh_model(case):
    fresh = GPTModel(case.config)
    buffers = dict(case.model.named_buffers())
    assert buffers.keys() == dict(fresh.named_buffers()).keys()
    for name, value in fresh.named_buffers():
        assert torch.equal(buffers[name], value), name


def _hf_load_balancing_loss(arch: str):
    return importlib.import_module(f"transformers.models.{arch}.modeling_{arch}").load_balancing_loss_func


def test_aux_loss_of_one_batch_matches_transformers(case):
    """Per layer, HF's loss is K times moe_core's; over the layers, HF's pooled loss is K times moe_core's Switch
    loss of the layer-pooled routing (docs/hf_interop.md)."""
    cfg, ids = case.config, ids_for(case)
    topk, experts = cfg.moe_router_topk, cfg.num_moe_experts
    router_inputs = []
    hooks = [layer.router.register_forward_pre_hook(lambda _m, args: router_inputs.append(args[0]))
             for layer in case.model.moe_layers()]
    case.model.train()
    try:
        case.model(ids, labels=ids)
    finally:
        case.model.eval()
        for h in hooks:
            h.remove()
    with torch.no_grad():
        out = case.hf(ids, labels=ids, output_router_logits=True)
    hf_loss = _hf_load_balancing_loss(case.hf.config.model_type)
    assert len(out.router_logits) == len(case.model.moe_layers())
    ours_logits = []
    for layer, hidden, hf_logits in zip(case.model.moe_layers(), router_inputs, out.router_logits, strict=True):
        logits = hidden.reshape(-1, cfg.hidden_size).float() @ layer.router.weight.float().t()
        torch.testing.assert_close(logits, hf_logits, rtol=0, atol=1e-5)
        ours_logits.append(logits.detach())
        single = hf_loss((hf_logits,), experts, topk)
        ours = layer.router.recorder.aux_losses()["aux_loss"].float()
        torch.testing.assert_close(topk * ours, single, rtol=1e-5, atol=0)
    scores, routing_map = routing_scores_for_aux_loss(torch.cat(ours_logits), "softmax", topk)
    pooled = switch_load_balancing_loss(scores, routing_map.sum(dim=0), scores.shape[0], topk)
    torch.testing.assert_close(topk * pooled, out.aux_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("num_layers,topk", [(1, 2), (3, 2), (16, 8)])
def test_aux_coefficient_conversion_equal_layer_routings(num_layers, topk):
    """With every layer routing alike, HF's coef * loss equals moe_core's converted coeff * sum of layer losses."""
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    hf = _hf_load_balancing_loss("mixtral")((logits,) * num_layers, 16, topk)
    scores, routing_map = routing_scores_for_aux_loss(logits, "softmax", topk)
    ours = switch_load_balancing_loss(scores, routing_map.sum(dim=0), 64, topk)
    coef = 0.02
    converted = aux_loss_coeff_from_hf(coef, topk, num_layers)
    torch.testing.assert_close(coef * hf.double(), converted * num_layers * ours, rtol=1e-6, atol=0)


def test_rope_cos_sin_equal_transformers_at_long_positions():
    """D 128, base 1e6 (Qwen3), positions 0..4095: bitwise HF's; the old ``base ** (-arange / D)`` is not."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    hf_config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=128,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    positions = torch.arange(4096).unsqueeze(0)
    hf_cos, hf_sin = Qwen3MoeRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(4096, 128, 1e6, torch.device("cpu"))
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    old_cos, _ = _old_rope_cos_sin(4096, 128, 1e6, torch.device("cpu"))
    assert (old_cos - hf_cos[0]).abs().max() > 1e-4


def _old_rope_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device):
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def test_long_position_logits_match_transformers(tmp_path, monkeypatch):
    """Positions up to 4096 at D 128 (RoPE's slow frequencies matter): logits within 5e-6 in float32; the old
    ``base ** (-arange / D)`` frequencies miss it (negative control)."""
    hf_config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = build_hf(hf_config)
    with torch.no_grad():  # small weights keep float32 logits near 1 over 4096 positions
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(0.5)
    hf.save_pretrained(tmp_path)
    config, model = load_hf(tmp_path)
    case_ = dataclasses.make_dataclass("Case", ["hf", "model", "config"])(hf, model.eval(), config)
    ids = ids_for(case_, batch=1, seq=4096)
    assert max_logit_error(case_, ids) <= 5e-6
    monkeypatch.setattr("moe_core.models.transformer_block.rope_cos_sin", _old_rope_cos_sin)
    assert max_logit_error(case_, ids) > 5e-6


def _qwen3_config(**changes):
    raw = json.loads(Qwen3MoeConfig(**TINY, hidden_size=32, num_experts=4).to_json_string(use_diff=True))
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes,message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_parameters"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(model_type="deepseek_v3"), "model_type='deepseek_v3'"),
])
def test_unsupported_config_fields_raise(changes, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(_qwen3_config(**changes))


def test_mixtral_sliding_window_and_olmoe_clip_qkv_raise():
    mixtral = json.loads(MixtralConfig(**TINY, hidden_size=32, sliding_window=64).to_json_string(use_diff=True))
    with pytest.raises(ValueError, match="sliding_window=64"):
        config_from_hf(mixtral)
    olmoe = json.loads(OlmoeConfig(**TINY, hidden_size=32, clip_qkv=8.0).to_json_string(use_diff=True))
    with pytest.raises(ValueError, match="clip_qkv=8.0"):
        config_from_hf(olmoe)


def test_bfloat16_load_and_export(tmp_path):
    """``dtype``: weights cast once on load (router counters stay float32, recorded losses float64); export writes
    bf16 and says so."""
    hf = build_hf(CASES["olmoe-e8k2-norm"]())
    hf.save_pretrained(tmp_path / "hf")
    config, model = load_hf(tmp_path / "hf" / "config.json", dtype=torch.bfloat16)  # a file in the directory
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32, torch.float64}
    save_hf(model, config, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    for key, value in hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value.to(torch.bfloat16)), key


def test_missing_and_misshapen_tensors_raise(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = build_hf(CASES["mixtral-gqa-hd16-e8k2"]())
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.7.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.block_sparse_moe.experts.7.w3.weight'\]"):
        load_hf(tmp_path)
    tensors["model.layers.1.block_sparse_moe.experts.7.w3.weight"] = torch.zeros(24, 31)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts.7.w3.weight has shape \(24, 31\)"):
        load_hf(tmp_path)


def test_save_hf_rejects_what_hf_cannot_hold(tmp_path):
    config = config_from_hf(json.loads(CASES["qwen3-gqa-hd16-e8k2"]().to_json_string(use_diff=True)))
    model = GPTModel(config)
    sigmoid = dataclasses.replace(config, moe_router_score_function="sigmoid")
    with pytest.raises(ValueError, match="moe_router_score_function='sigmoid'"):
        save_hf(model, sigmoid, tmp_path / "a")
    with pytest.raises(ValueError, match="max_shard_size"):
        save_hf(model, config, tmp_path / "b", max_shard_size="lots")
    save_hf(model, config, tmp_path / "c")
    with pytest.raises(FileExistsError, match="already holds"):
        save_hf(model, config, tmp_path / "c")
