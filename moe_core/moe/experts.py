"""Expert MLPs: ``GroupedMLP`` (one grouped GEMM per linear) and ``SequentialMLP`` (per-expert loop, reference).

Legend (docs/design.md): R routed rows on this rank (expert-major), H hidden, F expert ffn width, E local
experts.

Both follow Megatron's expert contract ``forward(permuted_local_hidden_states [R, H], tokens_per_expert [E],
permuted_probs [R]) -> (output [R, H], None)`` and compute, per row of expert e with prob p,
``p * (act(x @ W1_e + b1_e) @ W2_e + b2_e)``: by default the probs multiply the activation before fc2 and the
fc2 bias (Megatron's ``activation_func_with_probs`` and TEGroupedMLP's ``_apply_bias``); with
``moe_apply_probs_on_output`` they multiply the expert's output instead. Either way a padding row with p = 0
gives exactly 0 and combine only sums. Every expert's linears run on every call, also with R == 0 or an
expert without rows, so every rank builds the same autograd graph and every expert weight gets a gradient
(exactly zero when it saw no row), never None.

Under expert tensor parallelism the weights are DTensors of the ETP mesh (fc1 split by output columns, fc2 by
input rows, ``moe_core.models.tp_plan``) and each rank computes with its shard
(``tp_weights.local_shard``): its output rows are partial sums, reduced by ``MoELayer``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_core.activations import activation
from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.ops import grouped_gemm
from moe_core.ops.swiglu import swiglu_with_probs
from moe_core.parallel.tp_weights import local_shard
from moe_core.recompute import recompute_output


class GroupedLinear(nn.Module):
    """All experts' weights of one linear in a single parameter: ``weight`` [E, in, out], ``bias`` [E, out].

    Init: weight normal(0, std), bias zero.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        nn.init.normal_(self.weight, mean=0.0, std=std)
        self.bias = nn.Parameter(torch.zeros(num_experts, out_features)) if bias else None

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, row_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``x [R, in]`` expert-major, ``tokens_per_expert [E]`` int summing to at most R -> ``[R, out]``.

        Each row gets its expert's bias, times ``row_scale [R]`` when given; the unused rows past the counts'
        sum are unspecified (the grouped GEMM leaves them unwritten).
        """
        out = grouped_gemm(x, local_shard(self.weight), tokens_per_expert)
        if self.bias is None:
            return out
        # The unused rows form a last group with a zero bias; output_size keeps repeat_interleave from reading
        # the counts on the host.
        counts = tokens_per_expert.to(x.device)
        counts = torch.cat([counts, (x.shape[0] - counts.sum()).reshape(1)])
        expert_ids = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts,
                                             output_size=x.shape[0])
        bias = local_shard(self.bias)
        bias_rows = torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).index_select(0, expert_ids)
        if row_scale is not None:
            bias_rows = bias_rows * row_scale.unsqueeze(-1)
        return out + bias_rows.to(out.dtype)


class GroupedMLP(nn.Module):
    """The TEGroupedMLP equivalent: ``linear_fc1.weight`` [E, H, F] ([E, H, 2F] gated, gate half first),
    ``linear_fc2.weight`` [E, F, H], biases ``linear_fc1.bias`` [E, F or 2F] and ``linear_fc2.bias`` [E, H] with
    ``add_bias_linear`` (Megatron's names).

    Init: normal(0, init_method_std); fc2 with init_method_std / sqrt(2 * num_layers) (Megatron's
    output_layer_init_method, GPT-2's scaled residual init); biases zero.

    Args:
        num_local_experts: E, experts held by this rank.
        config: hidden_size, moe_ffn_hidden_size, activation_func, add_bias_linear, init_method_std, num_layers,
            moe_apply_probs_on_output.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig):
        super().__init__()
        _check_expert_config(num_local_experts, config)
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        std = config.init_method_std
        self.num_local_experts = num_local_experts
        self.activation_func = config.activation_func
        self.probs_on_output = config.moe_apply_probs_on_output
        self.recompute_activation = config.recomputes("moe_act")
        self.linear_fc1 = GroupedLinear(num_local_experts, config.hidden_size, fc1_out, config.add_bias_linear, std)
        self.linear_fc2 = GroupedLinear(num_local_experts, ffn, config.hidden_size, config.add_bias_linear,
                                        std / math.sqrt(2 * config.num_layers))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[R, H]``, ``[E]`` int (summing to at most R; the rows past the sum are unused, never read, their
        outputs and gradients unspecified), ``[R]`` float -> ``([R, H] in the input's dtype, None)``.

        No host sync. Raises ValueError / TypeError on mismatched shapes or dtypes.
        """
        x = permuted_local_hidden_states
        check_expert_inputs(x, tokens_per_expert, permuted_probs, self.num_local_experts,
                            self.linear_fc1.weight.shape[1])
        fc1_out = self.linear_fc1(x, tokens_per_expert)
        if self.probs_on_output:
            inputs = (fc1_out,)

            def act(fc1_out: torch.Tensor) -> torch.Tensor:
                return activation(fc1_out, self.activation_func)
        else:
            inputs, used_rows = (fc1_out, permuted_probs), tokens_per_expert.sum()

            def act(fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
                return _activation_with_probs(fc1_out, self.activation_func, probs, used_rows)

        # moe_act recompute: fc2 keeps no copy of the activation, backward makes it again from fc1's output.
        intermediate = recompute_output(act, *inputs) if self.recompute_activation else act(*inputs)
        if self.probs_on_output:
            return _scale_rows(self.linear_fc2(intermediate, tokens_per_expert), permuted_probs), None
        return self.linear_fc2(intermediate, tokens_per_expert, row_scale=permuted_probs), None


class SequentialMLP(nn.Module):
    """Per-expert ``MLP`` modules (``local_experts[e].linear_fc1`` / ``linear_fc2``, nn.Linear) run one after
    another: Megatron's ``SequentialMLP``, the parity reference of ``GroupedMLP``.

    Same contract, math and init as ``GroupedMLP``. Reads ``tokens_per_expert`` on the host (a sync),
    acceptable for a reference.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig):
        super().__init__()
        _check_expert_config(num_local_experts, config)
        self.num_local_experts = num_local_experts
        self.activation_func = config.activation_func
        self.probs_on_output = config.moe_apply_probs_on_output
        self.local_experts = nn.ModuleList(MLP(config, config.moe_ffn_hidden_size) for _ in range(num_local_experts))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """See ``GroupedMLP.forward``; every expert runs, on its possibly empty slice."""
        x = permuted_local_hidden_states
        hidden_size = self.local_experts[0].linear_fc1.in_features
        check_expert_inputs(x, tokens_per_expert, permuted_probs, self.num_local_experts, hidden_size)
        counts = tokens_per_expert.tolist()
        if sum(counts) > x.shape[0]:
            raise ValueError(f"tokens_per_expert: expected counts summing to at most R={x.shape[0]}, got {counts}")
        num_unused = x.shape[0] - sum(counts)
        outputs = []
        for expert, x_e, p_e in zip(self.local_experts, x.split(counts + [num_unused])[:-1],
                                    permuted_probs.split(counts + [num_unused])[:-1], strict=True):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            fc1_out = nn.functional.linear(x_e, local_shard(fc1.weight), local_shard(fc1.bias))
            if self.probs_on_output:
                out_e = nn.functional.linear(activation(fc1_out, self.activation_func), local_shard(fc2.weight),
                                             local_shard(fc2.bias))
                outputs.append(_scale_rows(out_e, p_e))
                continue
            out_e = nn.functional.linear(_activation_with_probs(fc1_out, self.activation_func, p_e),
                                         local_shard(fc2.weight))
            if fc2.bias is not None:
                out_e = out_e + (local_shard(fc2.bias) * p_e.unsqueeze(-1)).to(out_e.dtype)
            outputs.append(out_e)
        outputs.append(x.new_zeros(num_unused, hidden_size, dtype=outputs[0].dtype))
        return torch.cat(outputs, dim=0), None


@torch.no_grad()
def copy_sequential_to_grouped(sequential: SequentialMLP, grouped: GroupedMLP) -> None:
    """Copy each expert's nn.Linear weights ([out, in]) into the grouped [E, in, out] parameters (and biases).

    Raises:
        ValueError: the two modules differ in expert count or shapes.
    """
    if sequential.num_local_experts != grouped.num_local_experts:
        raise ValueError(
            f"grouped: expected {sequential.num_local_experts} experts like sequential, got {grouped.num_local_experts}"
        )
    for e, expert in enumerate(sequential.local_experts):
        for linear, grouped_linear in ((expert.linear_fc1, grouped.linear_fc1),
                                      (expert.linear_fc2, grouped.linear_fc2)):
            if linear.weight.t().shape != grouped_linear.weight.shape[1:]:
                raise ValueError(
                    f"grouped: expected weights [E, {linear.in_features}, {linear.out_features}], got "
                    f"{tuple(grouped_linear.weight.shape)}"
                )
            grouped_linear.weight[e].copy_(linear.weight.t())
            if (linear.bias is None) != (grouped_linear.bias is None):
                raise ValueError("grouped: expected biases exactly where sequential has them")
            if linear.bias is not None:
                grouped_linear.bias[e].copy_(linear.bias)


def check_expert_inputs(x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                        num_experts: int, hidden_size: int) -> None:
    """Raise ``ValueError``/``TypeError`` unless x is ``[R, H]``, tokens_per_expert ``[E]`` int, probs ``[R]``
    float. The sum of the counts is not checked here: that would be a host sync on the GPU."""
    if x.dim() != 2 or x.shape[1] != hidden_size:
        raise ValueError(f"permuted_local_hidden_states: expected [R, {hidden_size}], got {tuple(x.shape)}")
    if tokens_per_expert.shape != (num_experts,):
        raise ValueError(f"tokens_per_expert: expected [{num_experts}], got {tuple(tokens_per_expert.shape)}")
    if tokens_per_expert.is_floating_point() or tokens_per_expert.dtype == torch.bool:
        raise TypeError(f"tokens_per_expert: expected an integer dtype, got {tokens_per_expert.dtype}")
    if probs.shape != x.shape[:1]:
        raise ValueError(f"permuted_probs: expected [R={x.shape[0]}], got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"permuted_probs: expected a floating dtype, got {probs.dtype}")


def _activation_with_probs(fc1_out: torch.Tensor, name: str, probs: torch.Tensor,
                           used_rows: torch.Tensor | None = None) -> torch.Tensor:
    # SwiGLU runs fused with the probs (one pass each way, float32 inside), skipping the unused rows.
    if name == "swiglu":
        return swiglu_with_probs(fc1_out, probs, used_rows)
    return _scale_rows(activation(fc1_out, name), probs)


def _scale_rows(out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    # The product in the wider of the two dtypes (fp32 probs with bf16 outputs), then cast back.
    return (out * probs.unsqueeze(-1)).to(out.dtype)


def _check_expert_config(num_local_experts: int, config: TransformerConfig) -> None:
    if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 1:
        raise ValueError(f"num_local_experts: expected a positive int, got {num_local_experts!r}")
    if config.moe_ffn_hidden_size is None:
        raise ValueError("config.moe_ffn_hidden_size: expected an int (set num_moe_experts), got None")


__all__ = ["GroupedLinear", "GroupedMLP", "SequentialMLP", "copy_sequential_to_grouped", "check_expert_inputs"]
