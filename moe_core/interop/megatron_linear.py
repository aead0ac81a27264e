"""moe_core's grouped linear for Megatron-Core: the ``linear_fc1`` / ``linear_fc2`` of Megatron's ``TEGroupedMLP``
(its ``GroupedLinearFc1Builder`` / ``GroupedLinearFc2Builder`` protocols) and of ``MoECoreGroupedMLP``, on
``moe_core.ops.grouped_gemm``, without TransformerEngine.

Legend: R routed rows on this rank (expert-major), L local experts, I input width, O output width.

Mirrors TransformerEngine's ``GroupedLinear`` as Megatron wraps it (``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``): the builders' arguments, ``forward(x [R, I], tokens_per_expert) -> (y [R, O],
bias or None)``, and the state-dict keys ``weight0`` .. ``weight{L-1}`` ([O, I] each), ``bias0`` .. ``bias{L-1}``
([O] each) and ``_extra_state``. The weights live in one parameter ``weight`` [L, O, I], expert e's [O, I] block
contiguous (Megatron's per-expert layout), which the grouped GEMM reads with ``trans_weight=True``: no step stacks
or copies them. State-dict hooks show it expert by expert, and loading takes either form (Megatron's
``TEGroupedLinear`` does the same for ``moe_single_grouped_weight``).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name
from torch import nn

from moe_core.ops import grouped_gemm


def check_megatron_config(config, owner: str) -> None:
    """Raise ``ValueError`` naming the field when Megatron's ``TransformerConfig`` asks for what moe_core's grouped
    linears do not do: FP8 / FP4 (they compute in the parameters' dtype) or expert tensor parallelism."""
    for field in ("fp8", "fp4"):
        if getattr(config, field, None):
            raise ValueError(f"config.{field}: {owner} computes in params_dtype (bf16, fp16 or fp32), got "
                             f"{getattr(config, field)!r}")
    if (config.expert_tensor_parallel_size or 1) != 1:
        raise ValueError(f"config.expert_tensor_parallel_size: {owner} supports 1, got "
                         f"{config.expert_tensor_parallel_size}")


def expert_of_rows(tokens_per_expert_L: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[R]`` int64: the local expert of each row, ``L`` for the rows past the counts' sum. No host sync.

    Args:
        tokens_per_expert_L: ``[L]`` integer counts on the rows' device, summing to at most ``num_rows``.
    """
    counts = tokens_per_expert_L.long()
    counts = torch.cat([counts, (num_rows - counts.sum()).reshape(1)])
    # output_size keeps repeat_interleave from reading the counts on the host.
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=num_rows)


def bias_rows(bias_LO: torch.Tensor, expert_of_rows_R: torch.Tensor) -> torch.Tensor:
    """``[R, O]``: each row's expert bias from ``bias_LO`` [L, O]; zero for rows past the counts' sum (index L)."""
    return torch.cat([bias_LO, bias_LO.new_zeros(1, bias_LO.shape[1])]).index_select(0, expert_of_rows_R)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


class MoECoreGroupedLinear(nn.Module):
    """All local experts' ``y_e = x_e @ W_e^T (+ b_e)`` in one grouped GEMM; see the module docstring.

    Parameters: ``weight`` [L, O, I] (``config.params_dtype``; each [O, I] block initialised by ``init_method`` as
    Megatron initialises one expert, under the expert-parallel RNG tracker on the GPU), ``bias`` [L, O] (zero) when
    ``bias``. Both carry Megatron's ``allreduce`` (False where experts use the expert-parallel groups: expert-DP
    gradient reduction) and tensor-parallel attributes.

    Args (Megatron's ``GroupedLinearFc1Builder`` / ``GroupedLinearFc2Builder``):
        num_local_experts, input_size, output_size: L, I, O (positional).
        config: Megatron's ``TransformerConfig`` (``params_dtype``, ``use_cpu_initialization``,
            ``perform_initialization``, ``gradient_accumulation_fusion``, parallel sizes; see
            ``check_megatron_config``).
        init_method: called on each expert's [O, I] weight. bias: add ``bias``. skip_bias_add: return the bias
            instead of adding it. is_expert: must be True. tp_comm_buffer_name, pg_collection, name: accepted
            for the protocol (no communication happens here).
    Raises:
        ValueError: a non-positive size, ``is_expert=False``, or a config ``check_megatron_config`` refuses.
    """

    partition_dim: int  # the weight's dimension tensor parallelism would split (Megatron's partition_dim)

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 pg_collection=None, name: str | None = None):
        super().__init__()
        num_local_experts = _positive_int(num_local_experts, "num_local_experts")
        input_size, output_size = _positive_int(input_size, "input_size"), _positive_int(output_size, "output_size")
        if not is_expert:
            raise ValueError(f"is_expert: {type(self).__name__} holds experts only, got {is_expert!r}")
        check_megatron_config(config, type(self).__name__)
        self.num_local_experts = num_local_experts
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = bool(config.gradient_accumulation_fusion)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = nn.Parameter(torch.empty(num_local_experts, output_size, input_size, device=device,
                                               dtype=config.params_dtype))
        self.bias = (nn.Parameter(torch.zeros(num_local_experts, output_size, device=device,
                                              dtype=config.params_dtype)) if bias else None)
        if config.perform_initialization:
            self._initialize(init_method)
        uses_expert_groups = (config.expert_model_parallel_size > 1
                              or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        set_tensor_model_parallel_attributes(self.weight, True, self.partition_dim, 1)
        self.weight.allreduce = not uses_expert_groups
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, self.partition_dim == 1, 1, 1)
            self.bias.allreduce = not uses_expert_groups
        self.register_state_dict_post_hook(_per_expert_keys)
        self.register_load_state_dict_pre_hook(_stacked_keys)

    @torch.no_grad()
    def _initialize(self, init_method) -> None:
        tracker = get_cuda_rng_tracker()
        on_gpu = self.weight.is_cuda and tracker.is_initialized()
        for weight_OI in self.weight:
            if on_gpu:
                with tracker.fork(get_expert_parallel_rng_tracker_name()):
                    init_method(weight_OI)
            else:
                init_method(weight_OI)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` [R, I] expert-major in the weight's dtype (or under autocast), ``tokens_per_expert`` [L] (a
        tensor on any device, read only on the device, or Megatron's list of ints) summing to at most R.

        Returns:
            ``(y [R, O], None)``, the bias added to each row of its expert; with ``skip_bias_add`` and a bias,
            ``(y, bias [L, O])`` (one row per expert, as TE's list of per-expert biases). Rows past the counts'
            sum are unspecified.
        Raises:
            TypeError / ValueError: from ``grouped_gemm`` when shapes, dtypes or counts do not fit.
        """
        counts = tokens_per_expert if isinstance(tokens_per_expert, torch.Tensor) else torch.tensor(
            tokens_per_expert, dtype=torch.int64)
        counts = counts.to(x.device, non_blocking=True)
        y = grouped_gemm(x, self.weight, counts, trans_weight=True,
                         gradient_accumulation_fusion=self.gradient_accumulation_fusion)
        if self.bias is None:
            return y, None
        if self.skip_bias_add:
            return y, self.bias
        return y + bias_rows(self.bias, expert_of_rows(counts, x.shape[0])).to(y.dtype), None

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: nothing to do, backward computes the weight gradients."""

    def get_extra_state(self) -> None:
        """``_extra_state`` is None (Megatron's local linears write the same); TE's FP8 metadata is not used."""
        return None

    def set_extra_state(self, state) -> None:
        """Ignores the loaded ``_extra_state`` (TE's FP8 scaling metadata has no meaning here)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed checkpoint format is not supported: raises ``NotImplementedError``."""
        raise NotImplementedError(
            f"{prefix or type(self).__name__}: moe_core's grouped linears do not write Megatron's distributed "
            "checkpoints; save with --ckpt-format torch (state_dict keys weight0.. as TEGroupedMLP's)")


class MoECoreColumnParallelGroupedLinear(MoECoreGroupedLinear):
    """``linear_fc1``: Megatron's ``TEColumnParallelGroupedLinear`` (O is the partitioned dimension)."""

    partition_dim = 1


class MoECoreRowParallelGroupedLinear(MoECoreGroupedLinear):
    """``linear_fc2``: Megatron's ``TERowParallelGroupedLinear`` (I is the partitioned dimension)."""

    partition_dim = 2


def _per_expert_keys(module: MoECoreGroupedLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    # weight [L, O, I] -> weight0 .. weight{L-1} [O, I] (views); bias [L, O] -> bias0 ..
    for name in ("weight", "bias"):
        stacked = state_dict.pop(prefix + name, None)
        if stacked is not None:
            state_dict.update({f"{prefix}{name}{e}": t for e, t in enumerate(stacked.unbind(0))})


def _stacked_keys(module: MoECoreGroupedLinear, state_dict: dict, prefix: str, local_metadata, strict,
                  missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    # weight0 .. weight{L-1} -> weight [L, O, I]; an expert whose key is absent keeps its value and is reported as
    # missing under its own key (strict loading then fails naming it). A stacked `weight` loads as it is.
    for name, param in (("weight", module.weight), ("bias", module.bias)):
        if param is None:
            continue
        keys = [f"{prefix}{name}{e}" for e in range(module.num_local_experts)]
        present = [key in state_dict for key in keys]
        if prefix + name in state_dict:
            if any(present):
                raise ValueError(f"{prefix}{name}: expected either the stacked tensor or {keys[0]} .., got both")
            continue
        stacked = torch.empty_like(param) if all(present) else param.detach().clone()
        for e, key in enumerate(keys):
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict.pop(key)
            if not isinstance(value, torch.Tensor) or value.shape != param.shape[1:]:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{key}: expected a tensor of shape {tuple(param.shape[1:])}, got {got}")
            stacked[e].copy_(value)
        state_dict[prefix + name] = stacked


__all__ = ["MoECoreGroupedLinear", "MoECoreColumnParallelGroupedLinear", "MoECoreRowParallelGroupedLinear",
           "check_megatron_config", "expert_of_rows", "bias_rows"]
