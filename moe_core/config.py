"""TransformerConfig: one keyword-only dataclass for the model, the MoE layer and the router.

Field names follow Megatron-LM's ``TransformerConfig`` (megatron/core/transformer/transformer_config.py)
where Megatron has one, so a Megatron user can read a moe_core YAML without a glossary. Validation
happens in ``__post_init__`` and raises ``ValueError``/``TypeError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import stat
import types
import typing
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu", "relu", "squared_relu")
GATED_ACTIVATIONS = ("swiglu", "geglu")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
TOKEN_DROP_POLICIES = ("probs", "position")
DISPATCHER_TYPES = ("alltoall", "allgather")
ROUTER_DTYPES = ("fp32", "fp64", None)
QK_LAYERNORM_SPANS = ("head", "projection")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mlp", "moe", "shared_experts")
INT64_MAX = 2**63 - 1  # sizes and counts become int64 tensors and C++ int64s
CONFIG_SECTIONS = ("model", "training")  # the top-level keys of a run's YAML


@dataclass(kw_only=True)
class TransformerConfig:
    # --- model shape ---
    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (GQA); None means num_attention_heads (MHA)."""
    kv_channels: int | None = None
    """Per-head dimension; None means hidden_size // num_attention_heads."""
    ffn_hidden_size: int | None = None
    """Dense MLP width; None means 4 * hidden_size."""
    vocab_size: int = 256
    """Vocabulary size (256 for the byte tokenizer)."""
    seq_length: int = 128
    """Training sequence length in tokens."""
    activation_func: str = "swiglu"
    """One of ACTIVATIONS; swiglu and geglu are gated (fc1 produces 2 * ffn width)."""
    add_bias_linear: bool = False
    """Bias on every linear layer (attention, dense MLP, experts)."""
    qk_layernorm: bool = False
    """RMSNorm on the queries and keys before RoPE (Qwen3, OLMoE); ``qk_layernorm_span`` sets its width."""
    qk_layernorm_span: str = "head"
    """One of QK_LAYERNORM_SPANS: ``head`` normalises each head over D (Qwen3, Megatron's q/k_layernorm);
    ``projection`` normalises the whole q projection [Nq * D] and k projection [Nkv * D] before the head
    split (OLMoE)."""
    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    rotary_base: float = 10000.0
    """RoPE base (theta)."""
    share_embeddings_and_output_weights: bool = False
    """Tie the output projection to the input embedding."""
    init_method_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    cross_entropy_chunk_size: int | None = None
    """Tokens per chunk of the loss: the output layer and cross-entropy run on this many tokens at a time and
    recompute their logits in backward, so ``[tokens, vocab]`` logits never exist whole (the TRL report's
    chunked loss). None: all tokens at once."""

    # --- MoE layer ---
    num_moe_experts: int | None = None
    """Routed experts per MoE layer; None makes every layer dense."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_ffn_hidden_size: int | None = None
    """Expert MLP width F; None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the shared expert (sum over shared experts); None: no shared expert."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(hidden @ w_gate) (Qwen2-MoE)."""
    moe_shared_expert_overlap: bool | None = None
    """Under EP on CUDA, run the shared expert on a side stream while the dispatcher communicates (needs a
    shared expert). None: off here; the trainer turns it on where it applies (``training.fast_path``)."""
    moe_layer_freq: int | list[int] = 1
    """int k: every k-th layer is MoE; list: 1 for MoE, 0 for dense, one entry per layer."""
    first_k_dense_replace: int = 0
    """The first k layers are dense whatever moe_layer_freq says (DeepSeek-V3's name; Megatron has none)."""
    moe_grouped_gemm: bool = True
    """GroupedMLP (one grouped GEMM per linear) if True, else SequentialMLP (per-expert loop)."""
    moe_token_dispatcher_type: str = "alltoall"
    """One of DISPATCHER_TYPES."""
    moe_dispatch_sync_free: bool | None = None
    """None: off here; the trainer turns it on where it applies (``training.fast_path``). EP dispatch without a host
    sync when compiled or captured in CUDA graphs (eagerly, one wait for the exchange of the token counts that
    checks them, ``moe.ep_counts``): every token travels to every EP rank and the expert rows are sized for
    the worst case (each token on all its local experts), the rows past ``tokens_per_expert``'s sum unused.
    Static shapes for a data-dependent routing (the all-to-all exchange then compiles into the layer's graph), at
    the cost of memory; worth it at small EP, where almost every token reaches every rank anyway. Every EP rank
    must pass the same number of tokens. The all-to-all dispatcher's only: the all-gather one sizes its rows from
    exchanged counts either way, so the pair is refused. moe_core's name; DeepEP's low-latency mode makes the same
    trade."""

    # --- router ---
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (Mixtral keeps False: top-k then softmax)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the selected probs by this (DeepSeek-V3: 2.5)."""
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (DeepSeek-V3: 8)."""
    moe_router_group_topk: int | None = None
    """Groups each token may use (DeepSeek-V3: 4)."""
    moe_router_dtype: str | None = "fp32"
    """Precision of the router logits and probs: fp32, fp64 or None (the input's)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to scores for selection only (DeepSeek-V3)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update, bias += rate * sign(mean_load - load)."""
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    """aux_loss, seq_aux_loss, global_aux_loss, none, or a list of them."""
    moe_aux_loss_coeff: float | list[float] = 0.0
    """Coefficient of each load-balancing loss (a list matching the type list)."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient (ST-MoE); None disables it."""
    moe_input_jitter_eps: float | None = None
    """Multiply router input by U(1 - eps, 1 + eps) in training (Switch Transformer)."""
    moe_expert_capacity_factor: float | None = None
    """Capacity per expert = factor * tokens * topk / experts; None: no dropping."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor, pad every expert to its capacity (static shapes, drop_and_pad)."""
    moe_token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: highest probs, or earliest position."""
    moe_apply_probs_on_output: bool = False
    """Where the experts apply each row's routing prob: False multiplies the activation before fc2 (Megatron's
    ``activation_func_with_probs``, fused into SwiGLU here), True multiplies the expert's output (fc2's result
    and bias), the placement of the classic weighted combine. Both compute ``p * expert(x)`` without biases."""

    # --- parallelism ---
    expert_model_parallel_size: int = 1
    """EP size: ranks over which the experts are split."""
    tensor_model_parallel_size: int = 1
    """TP size: attention heads (whole query groups), the dense MLP and the shared expert split over this many
    ranks (``moe_core.models.tp_plan``); requires ``sequence_parallel``."""
    sequence_parallel: bool = False
    """Split the sequence over the TP ranks outside attention and the MLPs (norms, router, experts, loss); every
    MoE layer then routes each token on exactly one TP rank. Required when tensor_model_parallel_size > 1
    (Megatron requires it with MoE; moe_core implements TP with it only); no effect at TP size 1."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP (ETP): each expert's fc1 split by columns and fc2 by rows over this many ranks; 1 or
    tensor_model_parallel_size. None: tensor_model_parallel_size (Megatron's default)."""

    # --- activation recompute (moe_core.recompute) ---
    recompute_granularity: str | None = None
    """None, or one of RECOMPUTE_GRANULARITIES: ``full`` recomputes whole layers (``recompute_method``),
    ``selective`` the parts ``recompute_modules`` names."""
    recompute_method: str | None = None
    """With ``full``, one of RECOMPUTE_METHODS: ``uniform`` checkpoints groups of ``recompute_num_layers`` layers,
    ``block`` the first ``recompute_num_layers`` layers one by one."""
    recompute_num_layers: int | None = None
    """With ``full``: the group size (``uniform``) or the number of recomputed layers (``block``)."""
    recompute_modules: list[str] | None = None
    """With ``selective``: entries of RECOMPUTE_MODULES; None means ``["core_attn"]`` (Megatron's default)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            _positive_int(self, name)
        if self.cross_entropy_chunk_size is not None:
            _positive_int(self, "cross_entropy_chunk_size")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _positive_int(self, "num_query_groups")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when kv_channels is not given"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        _positive_int(self, "kv_channels")
        if self.kv_channels % 2:
            raise ValueError(f"kv_channels must be even for RoPE, got {self.kv_channels}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        _positive_int(self, "ffn_hidden_size")
        _choice(self, "activation_func", ACTIVATIONS)
        _choice(self, "qk_layernorm_span", QK_LAYERNORM_SPANS)
        for name in ("layernorm_epsilon", "rotary_base", "init_method_std"):
            setattr(self, name, check_number(name, getattr(self, name), low=0.0, low_open=True))
        self._validate_router_numbers()
        self._validate_moe()
        self._validate_router()
        _positive_int(self, "expert_model_parallel_size")
        self._validate_tensor_parallel()
        self._validate_recompute()

    def _validate_recompute(self) -> None:
        """Megatron's rules: ``full`` needs a method and a layer count, ``selective`` takes modules only."""
        _choice(self, "recompute_granularity", (None, *RECOMPUTE_GRANULARITIES))
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ValueError("recompute_method, recompute_num_layers: recompute_granularity 'full' needs both, got "
                             f"{self.recompute_method!r} and {self.recompute_num_layers!r}")
        if not full and (self.recompute_method is not None or self.recompute_num_layers is not None):
            raise ValueError("recompute_method, recompute_num_layers: only with recompute_granularity 'full', got "
                             f"{self.recompute_method!r} and {self.recompute_num_layers!r} with "
                             f"{self.recompute_granularity!r}")
        if full:
            _choice(self, "recompute_method", RECOMPUTE_METHODS)
            _positive_int(self, "recompute_num_layers")
        if self.recompute_granularity != "selective":
            if self.recompute_modules is not None:
                raise ValueError(f"recompute_modules: only with recompute_granularity 'selective', got "
                                 f"{self.recompute_modules!r} with {self.recompute_granularity!r}")
            return
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        if set(self.recompute_modules) - set(RECOMPUTE_MODULES):
            raise ValueError(f"recompute_modules: expected a list of entries of {RECOMPUTE_MODULES}, got "
                             f"{self.recompute_modules!r}")
        if "moe_act" in self.recompute_modules and not self.moe_grouped_gemm:
            raise ValueError("recompute_modules: 'moe_act' recomputes GroupedMLP's activation; SequentialMLP "
                             "(moe_grouped_gemm=False) has none to recompute")

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (an entry of RECOMPUTE_MODULES)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def _validate_tensor_parallel(self) -> None:
        """TP, SP and ETP sizes: what each split needs to divide evenly (Megatron's checks)."""
        _positive_int(self, "tensor_model_parallel_size")
        tp = self.tensor_model_parallel_size
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = tp
        _positive_int(self, "expert_tensor_parallel_size")
        etp = self.expert_tensor_parallel_size
        if etp not in (1, tp):
            raise ValueError(f"expert_tensor_parallel_size: expected 1 or tensor_model_parallel_size ({tp}), got {etp}")
        if tp == 1:
            return
        if not self.sequence_parallel:
            raise ValueError(f"sequence_parallel: tensor_model_parallel_size {tp} requires sequence_parallel=True "
                             "(Megatron requires it with MoE; moe_core runs TP with sequence parallelism only)")
        divisible = {"num_query_groups": self.num_query_groups, "ffn_hidden_size": self.ffn_hidden_size,
                     "vocab_size": self.vocab_size, "seq_length": self.seq_length,
                     "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size}
        for name, value in divisible.items():
            if value is not None and value % tp:
                raise ValueError(f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp})")
        if self.add_bias_linear and self.gated_linear_unit:
            raise ValueError(f"add_bias_linear: biases of a gated MLP ({self.activation_func}) are not implemented "
                             f"with tensor_model_parallel_size {tp}")
        if self.qk_layernorm and self.qk_layernorm_span == "projection":
            raise ValueError("qk_layernorm_span: 'projection' normalises over the heads TP splits; with "
                             f"tensor_model_parallel_size {tp} use 'head'")
        if etp > 1 and self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size % etp:
            raise ValueError(f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) must be divisible by "
                             f"expert_tensor_parallel_size ({etp})")
        if etp > 1 and self.add_bias_linear and self.num_moe_experts is not None:
            raise ValueError(f"add_bias_linear: expert fc2 biases are not implemented with expert_tensor_parallel_size "
                             f"{etp}; use 1")
        if etp > 1 and self.moe_pad_expert_input_to_capacity:
            raise ValueError(f"moe_pad_expert_input_to_capacity: not implemented with expert_tensor_parallel_size "
                             f"{etp}; use 1")

    def _validate_moe(self) -> None:
        if self.num_moe_experts is None:
            return
        _positive_int(self, "num_moe_experts")
        _positive_int(self, "moe_router_topk")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk ({self.moe_router_topk}) must be <= num_moe_experts ({self.num_moe_experts})"
            )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        _positive_int(self, "moe_ffn_hidden_size")
        if self.moe_shared_expert_intermediate_size is not None:
            _positive_int(self, "moe_shared_expert_intermediate_size")
        elif self.moe_shared_expert_overlap:
            raise ValueError("moe_shared_expert_overlap requires moe_shared_expert_intermediate_size (a shared expert)")
        if isinstance(self.moe_layer_freq, list):
            if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                raise ValueError(
                    f"moe_layer_freq: expected a list of {self.num_layers} zeros and ones, got {self.moe_layer_freq}"
                )
        elif not isinstance(self.moe_layer_freq, int) or self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq: expected an int >= 1 or a list, got {self.moe_layer_freq!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"first_k_dense_replace must be in [0, num_layers={self.num_layers}], got {self.first_k_dense_replace}"
            )
        _choice(self, "moe_token_dispatcher_type", DISPATCHER_TYPES)
        if self.moe_dispatch_sync_free and self.moe_token_dispatcher_type != "alltoall":
            raise ValueError(f"moe_dispatch_sync_free: only the all-to-all dispatcher has a sync-free exchange; with "
                             f"moe_token_dispatcher_type {self.moe_token_dispatcher_type!r} it would do nothing")
        if self.num_moe_experts % self.expert_model_parallel_size:
            raise ValueError(
                f"num_moe_experts ({self.num_moe_experts}) must be divisible by "
                f"expert_model_parallel_size ({self.expert_model_parallel_size})"
            )

    def _validate_router(self) -> None:
        if self.num_moe_experts is None:
            return
        _choice(self, "moe_router_score_function", SCORE_FUNCTIONS)
        _choice(self, "moe_router_dtype", ROUTER_DTYPES)
        _choice(self, "moe_token_drop_policy", TOKEN_DROP_POLICIES)
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ValueError("moe_router_pre_softmax requires moe_router_score_function='softmax'")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ValueError("moe_router_num_groups and moe_router_group_topk must be given together")
        if self.moe_router_num_groups is not None:
            _positive_int(self, "moe_router_num_groups")
            _positive_int(self, "moe_router_group_topk")
            if self.num_moe_experts % self.moe_router_num_groups:
                raise ValueError(
                    f"num_moe_experts ({self.num_moe_experts}) must be divisible by "
                    f"moe_router_num_groups ({self.moe_router_num_groups})"
                )
            if self.moe_router_group_topk > self.moe_router_num_groups:
                raise ValueError(
                    f"moe_router_group_topk ({self.moe_router_group_topk}) must be <= "
                    f"moe_router_num_groups ({self.moe_router_num_groups})"
                )
            per_group = self.num_moe_experts // self.moe_router_num_groups
            if self.moe_router_topk > self.moe_router_group_topk * per_group:
                raise ValueError(
                    f"moe_router_topk ({self.moe_router_topk}) exceeds the experts reachable in "
                    f"moe_router_group_topk groups ({self.moe_router_group_topk} x {per_group})"
                )
        types = self.moe_router_load_balancing_type
        coeffs = self.moe_aux_loss_coeff
        types_list = types if isinstance(types, list) else [types]
        coeffs_list = coeffs if isinstance(coeffs, list) else [coeffs]
        for t in types_list:
            if t not in LOAD_BALANCING_TYPES:
                raise ValueError(
                    f"moe_router_load_balancing_type: expected entries of {LOAD_BALANCING_TYPES}, got {t!r}"
                )
        if isinstance(types, list) != isinstance(coeffs, list) or len(types_list) != len(coeffs_list):
            raise ValueError(
                "moe_aux_loss_coeff must be a float when moe_router_load_balancing_type is a string and a "
                f"list of the same length when it is a list; got {types!r} and {coeffs!r}"
            )
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity requires moe_expert_capacity_factor")

    def _validate_router_numbers(self) -> None:
        """Every float of the router: finite, and in the range its formula allows."""
        positive = {"low": 0.0, "low_open": True, "optional": True}
        non_negative = {"low": 0.0, "optional": True}
        ranges = {
            "moe_router_topk_scaling_factor": positive,
            "moe_router_bias_update_rate": non_negative,
            "moe_z_loss_coeff": non_negative,
            # The jitter multiplies by U(1 - eps, 1 + eps): eps >= 1 could zero or flip the router input.
            "moe_input_jitter_eps": {"low": 0.0, "high": 1.0, "high_open": True, "optional": True},
            "moe_expert_capacity_factor": positive,
        }
        for name, bounds in ranges.items():
            setattr(self, name, check_number(name, getattr(self, name), **bounds))
        coeffs = self.moe_aux_loss_coeff
        if isinstance(coeffs, list):
            self.moe_aux_loss_coeff = [check_number(f"moe_aux_loss_coeff[{i}]", c, low=0.0)
                                       for i, c in enumerate(coeffs)]
        else:
            self.moe_aux_loss_coeff = check_number("moe_aux_loss_coeff", coeffs, low=0.0)

    # --- derived ---
    @property
    def gated_linear_unit(self) -> bool:
        """True when the activation is gated (fc1 produces two halves)."""
        return self.activation_func in GATED_ACTIVATIONS

    def single_process(self) -> TransformerConfig:
        """This config with every parallel size 1: the model one process holds whole."""
        return dataclasses.replace(self, expert_model_parallel_size=1, tensor_model_parallel_size=1,
                                   expert_tensor_parallel_size=1, sequence_parallel=False)

    @property
    def num_local_experts(self) -> int:
        """Experts held by one EP rank."""
        return (self.num_moe_experts or 0) // self.expert_model_parallel_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 0-based ``layer_number`` is an MoE layer (moe_layer_freq, then first_k_dense_replace)."""
        if self.num_moe_experts is None or layer_number < self.first_k_dense_replace:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer_number])
        return layer_number % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        """Build from a mapping; unknown keys, and missing required ones, raise ``ValueError`` naming them."""
        fields = dataclasses.fields(cls)
        unknown = sorted(set(values) - {f.name for f in fields})
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {unknown}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise ValueError(f"TransformerConfig: missing required fields {missing}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TransformerConfig:
        """The ``model:`` section of the run YAML ``path`` (``load_config_section``), then non-None ``overrides``."""
        values = dict(load_config_section(path, "model"))
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.from_dict(values)
        except ValueError as e:
            if "TransformerConfig" not in str(e):
                raise
            raise ValueError(f"{path}: model: {e}") from None


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, optional: bool = False) -> float | None:
    """``value`` as a float after checking it is a finite int or float within the bounds (None passes when
    ``optional``).

    Raises:
        TypeError: not a number (a bool, a string, ...).
        ValueError: NaN, infinite, or outside ``low`` / ``high`` (``*_open``: the bound itself is excluded).
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expected = "a number or None" if optional else "a number"
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} ({value!r})")
    bounds = [f"{'>' if low_open else '>='} {low:g}" if low is not None else "",
              f"{'<' if high_open else '<='} {high:g}" if high is not None else ""]
    expected = " and ".join(b for b in bounds if b)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not math.isfinite(value) or too_low or too_high:
        raise ValueError(f"{name}: expected a finite number{' ' + expected if expected else ''}, got {value}")
    return float(value)


# YAML 1.1 (PyYAML) reads 3e-3 and 1e5 as strings: a float needs a dot there. This is YAML 1.2's float
# pattern (exponent without a dot), plus 1.1's forms PyYAML already knew.
_YAML_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats (``3e-3`` is a float), without anchors and aliases (nested
    aliases expand exponentially: a few lines can exhaust memory) and without duplicate keys (which would take the
    last value silently)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            got = f"{'*' if isinstance(event, yaml.AliasEvent) else '&'}{event.anchor}"
            raise yaml.composer.ComposerError(None, None, f"anchors and aliases are not allowed, got {got}; write "
                                              "the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base class refuses it
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first_line[key]})", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in _Loader.yaml_implicit_resolvers.items()}
for _first in list("-+0123456789."):
    _Loader.yaml_implicit_resolvers[_first] = [
        (tag, regexp) for tag, regexp in _Loader.yaml_implicit_resolvers.get(_first, [])
        if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))


def require_regular_file(name: str, path: str | Path) -> Path:
    """``path`` as a ``Path`` once it is checked to be a regular file (after symlinks): a FIFO would block the
    reader and a device such as ``/dev/zero`` never ends.

    Raises:
        ValueError: ``path`` is missing or not a regular file; names the argument ``name`` and the path.
    """
    try:
        mode = Path(path).stat().st_mode
    except OSError as e:
        raise ValueError(f"{name}: {path}: cannot read it ({e.strerror})") from e
    if not stat.S_ISREG(mode):
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "another kind of file")
        raise ValueError(f"{name}: {path}: expected a regular file, got {kind}")
    return Path(path)


def load_yaml(path: str | Path) -> dict:
    """The mapping in the YAML file ``path`` (empty file: ``{}``), numbers read as YAML 1.2 reads them.

    Raises:
        ValueError: ``path`` is not a regular file, is not UTF-8 or not valid YAML, holds an anchor, an alias or a
            key given twice in one mapping, or is not a mapping; names the file (and the line).
    """
    text = require_regular_file("config", path).read_bytes()
    try:
        data = yaml.load(text.decode("utf-8"), Loader=_Loader) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: byte {e.start} is not valid UTF-8 ({e.reason})") from e
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: {e.problem or e.context}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data


def load_config_section(path: str | Path, section: str) -> dict:
    """The ``section`` mapping (one of CONFIG_SECTIONS) of the run YAML ``path``; ``{}`` when absent or empty.

    Raises:
        ValueError: as ``load_yaml``, a top-level key that is not one of CONFIG_SECTIONS (a misspelled
            ``training:`` would otherwise be ignored), or a section that is not a mapping; names the file.
    """
    data = load_yaml(path)
    unknown = sorted(set(data) - set(CONFIG_SECTIONS), key=str)
    if unknown:
        raise ValueError(f"{path}: unknown top-level sections {unknown}; a config holds only "
                         f"{', '.join(s + ':' for s in CONFIG_SECTIONS)}")
    values = data.get(section) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: {section}: expected a mapping of fields, got {type(values).__name__}")
    return values


def check_field_types(config: Any) -> None:
    """Check every field of the dataclass instance ``config`` against its annotation: ``bool`` only True or
    False (a YAML ``"false"`` is a string), ``int`` an int but not a bool, ``float`` an int or float but not a
    bool, ``str``, ``None``, ``list[X]`` and unions of these.

    Raises:
        TypeError: names the first field that does not match, what it expects and what came.
    """
    for name, annotation in _field_types(type(config)).items():
        value = getattr(config, name)
        if not _matches(value, annotation):
            raise TypeError(f"{name}: expected {_describe(annotation)}, got {type(value).__name__} ({value!r})")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SCALARS = {bool: ("a bool", "bools"), int: ("an int", "ints"), float: ("a number", "numbers"),
            str: ("a string", "strings"), type(None): ("None", "Nones")}


def _matches(value: Any, annotation: Any) -> bool:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in _SCALARS:
        return isinstance(value, annotation)
    raise TypeError(f"check_field_types: annotation {annotation} is not supported")


def _describe(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"a list of {_SCALARS[typing.get_args(annotation)[0]][1]}"
    return _SCALARS[annotation][0]


def _positive_int(cfg: TransformerConfig, name: str) -> None:
    value = getattr(cfg, name)  # an int: check_field_types ran
    if not 1 <= value <= INT64_MAX:
        raise ValueError(f"{name}: expected a positive int <= 2**63 - 1, got {value}")


def _choice(cfg: TransformerConfig, name: str, choices: tuple) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


__all__ = ["TransformerConfig", "ACTIVATIONS", "GATED_ACTIVATIONS"]
