"""Using moe_core inside Megatron-Core (``pip install megatron-core``): experts for Megatron's ``MoELayer``, grouped
linears for Megatron's own ``TEGroupedMLP``, and layer specs that use them (README: "Using moe_core inside
Megatron-Core").

- ``MoECoreGroupedMLP``: ``TEGroupedMLP``'s place and contract, ``tokens_per_expert`` never read on the host.
- ``MoECoreColumnParallelGroupedLinear`` / ``MoECoreRowParallelGroupedLinear``: Megatron's
  ``GroupedLinearFc1Builder`` / ``GroupedLinearFc2Builder``, per-expert state-dict keys ``weight0`` ...
- ``with_moe_core_experts(spec)``, ``te_grouped_mlp_with_moe_core_linears()``: specs.
- ``sequential_to_grouped_keys(state_dict)``: ``SequentialMLP``'s expert keys in ``TEGroupedMLP``'s layout.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as e:
    raise ImportError("moe_core.interop.megatron needs megatron-core: pip install megatron-core") from e

from moe_core.interop.megatron_experts import MoECoreGroupedMLP, sequential_to_grouped_keys
from moe_core.interop.megatron_linear import MoECoreColumnParallelGroupedLinear, MoECoreRowParallelGroupedLinear
from moe_core.interop.megatron_spec import te_grouped_mlp_with_moe_core_linears, with_moe_core_experts

__all__ = ["MoECoreGroupedMLP", "MoECoreColumnParallelGroupedLinear", "MoECoreRowParallelGroupedLinear",
           "sequential_to_grouped_keys", "with_moe_core_experts", "te_grouped_mlp_with_moe_core_linears"]
