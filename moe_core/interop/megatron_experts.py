"""``MoECoreGroupedMLP``: moe_core's experts for Megatron-Core's ``MoELayer``, in the place of ``TEGroupedMLP``.

Legend: R routed rows on this rank (expert-major), L local experts, H hidden (or ``moe_latent_size``), F expert
FFN width (``moe_ffn_hidden_size``; a gated fc1 gives 2F).

Megatron's experts contract (``ExpertsBuilder`` / ``ExpertsInterface`` in ``moe_layer.py``): built as
``MoECoreGroupedMLP(num_local_experts, config, pg_collection=..., name=...)``, called as
``experts(dispatched_input [R, H], tokens_per_expert [L], permuted_probs [R]) -> (output [R, H], None)``. Unlike
``TEGroupedMLP`` it never reads ``tokens_per_expert`` on the host (no ``.tolist()``): both linears are grouped
GEMMs (``MoECoreColumnParallelGroupedLinear`` / ``MoECoreRowParallelGroupedLinear``) that take the counts on the
device, and every expert's GEMMs run also when a rank gets no rows, so its weights get exactly-zero gradients and
every rank builds the same autograd graph. State-dict keys are ``TEGroupedMLP``'s (``linear_fc1.weight0`` ..);
``SequentialMLP``'s (``local_experts.<e>.linear_fc1.weight`` ..) load too.

Math per row of expert e with router prob p (Megatron's ``TEGroupedMLP`` semantics):
``(act(x W1_e^T + b1_e) * p) W2_e^T + b2_e * p``, act = ``config.activation_func`` (gated with
``gated_linear_unit``: ``act(gate) * (up + glu_linear_offset)``, both halves clamped by
``activation_func_clamp_value``); with ``moe_apply_probs_on_input`` x is scaled by p first and p is then 1.
SwiGLU without clamp or offset runs moe_core's fused ``swiglu_with_probs`` (float32 inside, one rounding).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from moe_core.interop.megatron_linear import (
    MoECoreColumnParallelGroupedLinear,
    MoECoreRowParallelGroupedLinear,
    bias_rows,
    check_megatron_config,
    expert_of_rows,
)
from moe_core.moe.experts import check_expert_inputs
from moe_core.ops.swiglu import swiglu_with_probs

_SEQUENTIAL_KEY = re.compile(r"(.*)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias|_extra_state)")


class MoECoreGroupedMLP(MegatronModule):
    """Experts ``linear_fc1`` ([L, 2F or F, H] weight, [L, 2F or F] bias with ``add_bias_linear``) and
    ``linear_fc2`` ([L, H, F], [L, H]); see the module docstring.

    Init as Megatron's: fc1 with ``config.init_method``, fc2 with ``config.output_layer_init_method``, per expert;
    biases zero.

    Args:
        num_local_experts: L, the experts this rank holds (``num_moe_experts / expert_model_parallel_size``).
        config: Megatron's ``TransformerConfig`` (``moe_ffn_hidden_size``, ``gated_linear_unit``,
            ``activation_func``, ``add_bias_linear``, ``moe_apply_probs_on_input``, ``moe_latent_size``, ...).
        pg_collection: Megatron's ``ProcessGroupCollection`` (unused: the dispatcher does the communication).
        name: Megatron's module name.
    Raises:
        ValueError: naming the config field: ``moe_ffn_hidden_size`` unset, ``moe_mlp_glu_interleave_size`` set,
            ``moe_act`` recompute, or what ``check_megatron_config`` refuses (FP8 / FP4, expert TP).
    """

    def __init__(self, num_local_experts: int, config, /, *, pg_collection=None, name: str | None = None):
        super().__init__(config=config)
        _check_config(config)
        ffn = config.moe_ffn_hidden_size
        self.input_size = config.moe_latent_size or config.hidden_size
        self.num_local_experts = num_local_experts
        common = dict(config=config, bias=config.add_bias_linear, is_expert=True, pg_collection=pg_collection)
        self.linear_fc1 = MoECoreColumnParallelGroupedLinear(
            num_local_experts, self.input_size, 2 * ffn if config.gated_linear_unit else ffn,
            init_method=config.init_method, skip_bias_add=False, tp_comm_buffer_name="fc1",
            name=None if name is None else f"{name}.linear_fc1", **common)
        self.linear_fc2 = MoECoreRowParallelGroupedLinear(
            num_local_experts, ffn, self.input_size, init_method=config.output_layer_init_method,
            skip_bias_add=True, tp_comm_buffer_name="fc2", name=None if name is None else f"{name}.linear_fc2",
            **common)
        self._fused_swiglu = (config.gated_linear_unit and config.activation_func is F.silu
                             and config.activation_func_clamp_value is None and not config.glu_linear_offset)
        self.register_load_state_dict_pre_hook(_sequential_keys)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[R, H]`` (params_dtype, or under autocast), ``[L]`` int on any device (summing to R; never read on
        the host), ``[R]`` float -> ``([R, H] in the input's dtype, None)``.

        Raises:
            ValueError / TypeError: mismatched shapes or dtypes (the counts' sum is not checked on the GPU).
        """
        x = permuted_local_hidden_states
        check_expert_inputs(x, tokens_per_expert, permuted_probs, self.num_local_experts, self.input_size)
        # Megatron's all-to-all dispatcher hands the counts over on the host: copied without waiting for the GPU.
        counts = tokens_per_expert.to(x.device, non_blocking=True)
        probs = permuted_probs
        if self.config.moe_apply_probs_on_input:
            x = (x * probs.unsqueeze(-1)).to(x.dtype)
            probs = torch.ones_like(probs)
        fc1_out, _ = self.linear_fc1(x, counts)
        out, bias = self.linear_fc2(self._activation_with_probs(fc1_out, probs), counts)
        if bias is not None:
            out = (out + bias_rows(bias, expert_of_rows(counts, x.shape[0])) * probs.unsqueeze(-1)).to(out.dtype)
        return out, None

    def _activation_with_probs(self, fc1_out: torch.Tensor, probs_R: torch.Tensor) -> torch.Tensor:
        if self._fused_swiglu:
            return swiglu_with_probs(fc1_out, probs_R)
        config = self.config
        if config.gated_linear_unit:
            gate, up = fc1_out.chunk(2, dim=-1)
            if config.activation_func_clamp_value is not None:
                gate = gate.clamp(max=config.activation_func_clamp_value)
                up = up.clamp(-config.activation_func_clamp_value, config.activation_func_clamp_value)
            hidden = config.activation_func(gate) * (up + config.glu_linear_offset)
        else:
            hidden = config.activation_func(fc1_out)
        return (hidden * probs_R.unsqueeze(-1)).to(hidden.dtype)

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: nothing to do, backward computes the weight gradients."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed checkpoint format is not supported: raises ``NotImplementedError`` (the
        linears' own refusal)."""
        return self.linear_fc1.sharded_state_dict(f"{prefix}linear_fc1.", sharded_offsets, metadata)


def _check_config(config) -> None:
    owner = MoECoreGroupedMLP.__name__
    check_megatron_config(config, owner)
    if config.moe_ffn_hidden_size is None:
        raise ValueError("config.moe_ffn_hidden_size: expected an int, got None")
    if getattr(config, "moe_mlp_glu_interleave_size", None) is not None:
        raise ValueError(f"config.moe_mlp_glu_interleave_size: {owner} expects None ([gate; up] halves), got "
                         f"{config.moe_mlp_glu_interleave_size}")
    if config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or ()):
        raise ValueError(f"config.recompute_modules: {owner} does not recompute 'moe_act', got "
                         f"{config.recompute_modules}")


def sequential_to_grouped_keys(state_dict: dict) -> dict:
    """A copy of ``state_dict`` with Megatron ``SequentialMLP``'s expert keys in ``TEGroupedMLP``'s layout, which
    ``MoECoreGroupedMLP`` and ``TEGroupedMLP`` on moe_core's linears share: ``<p>local_experts.<e>.linear_fc1.weight``
    -> ``<p>linear_fc1.weight<e>`` (likewise ``linear_fc2``, ``bias``); the experts' ``_extra_state`` (None in
    Megatron's local linears) becomes one ``<p>linear_fc1._extra_state`` (and ``linear_fc2``'s). Other keys are
    kept; tensors are not copied. ``MoECoreGroupedMLP.load_state_dict`` applies it itself."""
    grouped = {}
    for key, value in state_dict.items():
        match = _SEQUENTIAL_KEY.fullmatch(key)
        if match is None:
            grouped[key] = value
            continue
        prefix, expert, linear, name = match.groups()
        if name == "_extra_state":
            grouped.setdefault(f"{prefix}{linear}._extra_state", value)
        else:
            grouped[f"{prefix}{linear}.{name}{expert}"] = value
    return grouped


def _sequential_keys(module: MoECoreGroupedMLP, state_dict: dict, prefix: str, *args) -> None:
    sequential = [key for key in state_dict if key.startswith(prefix + "local_experts.")]
    state_dict.update(sequential_to_grouped_keys({key: state_dict.pop(key) for key in sequential}))


__all__ = ["MoECoreGroupedMLP", "sequential_to_grouped_keys"]
