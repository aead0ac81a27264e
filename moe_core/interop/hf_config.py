"""Hugging Face ``config.json`` <-> ``TransformerConfig`` for Qwen3-MoE, Mixtral and OLMoE.

Every key of a ``config.json`` is either mapped to a ``TransformerConfig`` field, or known to leave the
model's function alone (``INERT_KEYS``: token ids, dtype, bookkeeping); any other key, and any value that
moe_core's model cannot reproduce exactly, raises ``ValueError`` naming the key and the value. Values are
read through transformers' config classes, which also read the older spellings (``rope_theta``,
``torch_dtype``). The mapping, its conventions and the aux-loss conversion are in docs/hf_interop.md.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import MixtralConfig, OlmoeConfig, PretrainedConfig, Qwen3MoeConfig

from moe_core.config import TransformerConfig, check_number

HF_CONFIG_CLASSES = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig, "olmoe": OlmoeConfig}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "output_router_logits", "_name_or_path",
})
"""Keys that do not change the forward: metadata, token ids (``pad_token_id`` only freezes that embedding row
in HF's training), generation caching."""
_COMMON_KEYS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "max_position_embeddings", "hidden_act", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
    "tie_word_embeddings", "initializer_range", "num_experts_per_tok", "router_aux_loss_coef", "attention_dropout",
    "intermediate_size", "num_experts", "num_local_experts", "head_dim",
})
MAPPED_KEYS = {
    "qwen3_moe": _COMMON_KEYS | {"moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                                 "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers"},
    "mixtral": _COMMON_KEYS | {"sliding_window", "router_jitter_noise"},
    "olmoe": _COMMON_KEYS | {"norm_topk_prob", "attention_bias", "clip_qkv"},
}


def aux_loss_coeff_from_hf(router_aux_loss_coef: float, topk: int, num_moe_layers: int) -> float:
    """``moe_aux_loss_coeff`` of the same strength as HF's ``router_aux_loss_coef``: ``coef * K / L``.

    HF adds ``coef * K * Switch(layers pooled)`` once; moe_core adds ``coeff * Switch(layer)`` per MoE layer,
    with f divided by K (Megatron's convention). Equal per-layer routings give ``L`` times the same term on
    one side and ``K`` times it on the other (docs/hf_interop.md derives it).
    """
    return router_aux_loss_coef * topk / num_moe_layers


def aux_loss_coeff_to_hf(moe_aux_loss_coeff: float, topk: int, num_moe_layers: int) -> float:
    """The inverse of ``aux_loss_coeff_from_hf``: ``coeff * L / K``."""
    return moe_aux_loss_coeff * num_moe_layers / topk


def _require(ok: bool, key: str, value: Any, expected: str, source: str) -> None:
    if not ok:
        raise ValueError(f"{source}: {key}={value!r} is not supported by moe_core (expected {expected})")


def parse_hf_config(raw: dict[str, Any], source: str = "config.json") -> PretrainedConfig:
    """transformers' config object of a ``config.json`` (as a dict) of a supported ``model_type``, checked for
    contradictions transformers resolves silently.

    Args:
        raw: the parsed ``config.json``.
        source: how errors name the file (its path).
    Raises:
        ValueError: an unsupported ``model_type``; a field of the wrong type (transformers' validation); both
            ``num_experts`` and ``num_local_experts`` with different values; a legacy ``rope_theta`` beside
            another ``rope_parameters.rope_theta``; ``mlp_only_layers`` naming layers the model lacks; a
            ``decoder_sparse_step`` or ``num_attention_heads`` below 1.
    """
    arch = raw.get("model_type")
    _require(isinstance(arch, str) and arch in HF_CONFIG_CLASSES, "model_type", arch,
             f"one of {sorted(HF_CONFIG_CLASSES)}", source)
    if "num_experts" in raw and "num_local_experts" in raw and raw["num_experts"] != raw["num_local_experts"]:
        raise ValueError(f"{source}: num_experts={raw['num_experts']!r} and num_local_experts="
                         f"{raw['num_local_experts']!r} contradict each other (one expert count, or both equal)")
    rope = raw.get("rope_parameters")
    if "rope_theta" in raw and isinstance(rope, dict) and "rope_theta" in rope \
            and rope["rope_theta"] != raw["rope_theta"]:
        raise ValueError(f"{source}: rope_theta={raw['rope_theta']!r} and rope_parameters.rope_theta="
                         f"{rope['rope_theta']!r} contradict each other (keep rope_parameters only)")
    try:
        hf = HF_CONFIG_CLASSES[arch].from_dict(dict(raw))
    except (StrictDataclassError, ValueError, TypeError) as e:
        raise ValueError(f"{source}: {' '.join(str(e).split())}") from e
    heads = hf.num_attention_heads  # divides hidden_size into the default head_dim
    _require(isinstance(heads, int) and heads >= 1, "num_attention_heads", heads, "an int >= 1", source)
    if arch == "qwen3_moe":
        step = hf.decoder_sparse_step
        _require(isinstance(step, int) and step >= 1, "decoder_sparse_step", step, "an int >= 1", source)
        absent = [i for i in hf.mlp_only_layers or [] if not 0 <= i < hf.num_hidden_layers]
        if absent:
            raise ValueError(f"{source}: mlp_only_layers names layers {absent}, but num_hidden_layers="
                             f"{hf.num_hidden_layers} (layers 0 to {hf.num_hidden_layers - 1})")
    return hf


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face ``config.json`` (as a dict).

    ``seq_length`` is HF's ``max_position_embeddings`` (pass a shorter ``--seq-length`` to train); the
    aux-loss coefficient is converted with ``aux_loss_coeff_from_hf``; every layer uses grouped experts.
    ``source`` names the file in errors.

    Raises:
        ValueError: a config ``parse_hf_config`` refuses, a key outside ``MAPPED_KEYS`` and ``INERT_KEYS``, or
            a value moe_core cannot reproduce or ``TransformerConfig`` refuses (named with its value).
    """
    hf = parse_hf_config(raw, source)
    arch = hf.model_type
    unknown = sorted(set(raw) - MAPPED_KEYS[arch] - INERT_KEYS)
    if unknown:
        raise ValueError(f"{source}: unsupported {arch} fields {', '.join(f'{k}={raw[k]!r}' for k in unknown)}")
    heads, hidden = hf.num_attention_heads, hf.hidden_size
    rope = dict(hf.rope_parameters)
    _require(rope.get("rope_type", "default") == "default" and set(rope) <= {"rope_type", "rope_theta"},
             "rope_parameters", rope, "plain RoPE: rope_type 'default' and rope_theta only", source)
    _require(hf.hidden_act == "silu", "hidden_act", hf.hidden_act, "'silu' (SwiGLU)", source)
    _require(not hf.attention_dropout, "attention_dropout", hf.attention_dropout, "0", source)
    _require(not getattr(hf, "attention_bias", False), "attention_bias", True, "false", source)
    _require(not getattr(hf, "use_sliding_window", False), "use_sliding_window", True, "false", source)
    if arch == "mixtral":
        _require(hf.sliding_window is None, "sliding_window", hf.sliding_window, "null", source)
        _require(not hf.router_jitter_noise, "router_jitter_noise", hf.router_jitter_noise, "0", source)
    head_dim = _head_dim(hf)
    if arch == "olmoe":
        _require(hf.clip_qkv is None, "clip_qkv", hf.clip_qkv, "null", source)
        _require(head_dim == hidden // heads, "head_dim", head_dim, f"hidden_size / num_attention_heads = "
                 f"{hidden // heads} (OLMoE's QK-norm spans hidden_size)", source)
    num_layers, topk = hf.num_hidden_layers, hf.num_experts_per_tok
    moe_layers = _hf_moe_layers(hf, arch)
    try:
        rotary_base = check_number("rope_parameters.rope_theta", rope.get("rope_theta"), low=0, low_open=True)
        return TransformerConfig(
            num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=hf.num_key_value_heads or heads, kv_channels=head_dim,
            ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size, seq_length=hf.max_position_embeddings,
            activation_func="swiglu", qk_layernorm=arch != "mixtral",
            qk_layernorm_span="projection" if arch == "olmoe" else "head", layernorm_epsilon=hf.rms_norm_eps,
            rotary_base=rotary_base, share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
            init_method_std=hf.initializer_range, num_moe_experts=hf.num_experts, moe_router_topk=topk,
            moe_ffn_hidden_size=_expert_width(hf),
            moe_layer_freq=1 if all(moe_layers) else [int(m) for m in moe_layers],
            # norm_topk_prob: softmax over the K selected logits (renormalised); else the full softmax's top K.
            moe_router_pre_softmax=arch != "mixtral" and not hf.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=aux_loss_coeff_from_hf(hf.router_aux_loss_coef, topk, max(sum(moe_layers), 1)),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e} (docs/hf_interop.md maps config.json's fields to moe_core's)") from e


def _head_dim(hf: PretrainedConfig) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _expert_width(hf: PretrainedConfig) -> int:
    return hf.moe_intermediate_size if hf.model_type == "qwen3_moe" else hf.intermediate_size


def _hf_moe_layers(hf: PretrainedConfig, arch: str) -> list[bool]:
    """Which layers HF builds as MoE (Qwen3: ``decoder_sparse_step`` and ``mlp_only_layers``)."""
    if arch != "qwen3_moe":
        return [True] * hf.num_hidden_layers
    dense = set(hf.mlp_only_layers or [])
    return [i not in dense and (i + 1) % hf.decoder_sparse_step == 0 for i in range(hf.num_hidden_layers)]


def model_identity(hf: PretrainedConfig) -> dict[str, Any]:
    """The fields that tell one model's checkpoint from another's (its shapes and architecture), by their
    ``config.json`` names; ``moe_intermediate_size`` is the experts' width (Mixtral's and OLMoE's
    ``intermediate_size``)."""
    heads = hf.num_attention_heads
    return {"model_type": hf.model_type, "vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size,
            "num_hidden_layers": hf.num_hidden_layers, "num_attention_heads": heads,
            "num_key_value_heads": hf.num_key_value_heads or heads, "head_dim": _head_dim(hf),
            "num_experts": hf.num_experts, "moe_intermediate_size": _expert_width(hf)}


def hf_architecture(config: TransformerConfig) -> str:
    """The HF ``model_type`` that holds ``config``: its QK-norm tells them apart (none: Mixtral; per head:
    Qwen3-MoE; over the projection: OLMoE)."""
    if not config.qk_layernorm:
        return "mixtral"
    return "qwen3_moe" if config.qk_layernorm_span == "head" else "olmoe"


def config_to_hf(config: TransformerConfig, reference: dict[str, Any] | None = None, dtype=None) -> PretrainedConfig:
    """The HF config of ``config`` (``config_from_hf`` in reverse), architecture from ``hf_architecture``.

    Args:
        config: a ``TransformerConfig`` with experts.
        reference: an original ``config.json`` (dict) whose ``INERT_KEYS`` token ids and
            ``max_position_embeddings`` are kept; without it ``max_position_embeddings`` is ``seq_length``.
        dtype: the ``dtype`` entry (the weights' torch dtype), or None.
    Raises:
        ValueError: a field whose value HF's architecture cannot hold, named with the value. Training-only
            fields without an HF counterpart (z-loss, input jitter, expert-bias rate, router dtype, dispatcher,
            parallel sizes) are not written.
    """
    arch = hf_architecture(config)
    c = config
    _require_field(c.num_moe_experts is not None, "num_moe_experts", None, "an MoE model")
    _require_field(c.activation_func == "swiglu", "activation_func", c.activation_func, "'swiglu'")
    for name, default in (("add_bias_linear", False), ("moe_shared_expert_intermediate_size", None),
                          ("moe_router_topk_scaling_factor", None), ("moe_router_num_groups", None),
                          ("moe_router_enable_expert_bias", False), ("moe_expert_capacity_factor", None)):
        _require_field(getattr(c, name) == default, name, getattr(c, name), repr(default))
    _require_field(c.moe_router_score_function == "softmax", "moe_router_score_function",
                   c.moe_router_score_function, "'softmax'")
    balancing = c.moe_router_load_balancing_type
    _require_field(balancing in ("aux_loss", "none"), "moe_router_load_balancing_type", balancing,
                   "'aux_loss' or 'none'")
    moe_layers = [c.is_moe_layer(i) for i in range(c.num_layers)]
    _require_field(arch == "qwen3_moe" or all(moe_layers), "moe_layer_freq", c.moe_layer_freq,
                   f"every layer MoE for {arch}")
    _require_field(arch != "mixtral" or not c.moe_router_pre_softmax, "moe_router_pre_softmax", True,
                   "false for Mixtral (top-k then softmax)")
    _require_field(arch != "olmoe" or c.kv_channels * c.num_attention_heads == c.hidden_size, "kv_channels",
                   c.kv_channels, "hidden_size / num_attention_heads for OLMoE")
    coef = 0.0 if balancing == "none" else aux_loss_coeff_to_hf(c.moe_aux_loss_coeff, c.moe_router_topk,
                                                               max(sum(moe_layers), 1))
    values: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_query_groups, hidden_act="silu",
        max_position_embeddings=c.seq_length, initializer_range=c.init_method_std, rms_norm_eps=c.layernorm_epsilon,
        tie_word_embeddings=c.share_embeddings_and_output_weights, num_experts_per_tok=c.moe_router_topk,
        rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base}, router_aux_loss_coef=coef,
        architectures=[ARCHITECTURES[arch]],
    )
    if arch == "qwen3_moe":
        values.update(head_dim=c.kv_channels, intermediate_size=c.ffn_hidden_size, num_experts=c.num_moe_experts,
                      moe_intermediate_size=c.moe_ffn_hidden_size, norm_topk_prob=not c.moe_router_pre_softmax,
                      decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(moe_layers) if not m])
    elif arch == "mixtral":
        values.update(head_dim=c.kv_channels, intermediate_size=c.moe_ffn_hidden_size,
                      num_local_experts=c.num_moe_experts)
    else:
        values.update(intermediate_size=c.moe_ffn_hidden_size, num_experts=c.num_moe_experts,
                      norm_topk_prob=not c.moe_router_pre_softmax)
    if reference is not None:
        kept = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
        values.update({k: reference[k] for k in kept if k in reference})
    if dtype is not None:
        values["dtype"] = dtype
    return HF_CONFIG_CLASSES[arch](**values)


def _require_field(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"config.{name}={value!r} has no Hugging Face counterpart (expected {expected})")


__all__ = ["config_from_hf", "parse_hf_config", "model_identity", "config_to_hf", "hf_architecture",
           "aux_loss_coeff_from_hf", "aux_loss_coeff_to_hf", "HF_CONFIG_CLASSES", "ARCHITECTURES", "INERT_KEYS",
           "MAPPED_KEYS"]
