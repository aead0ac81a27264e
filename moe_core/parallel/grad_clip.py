"""Global gradient norm and clipping over dense and expert parameters living on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails for DTensors on different meshes
(dense: DP or DP x TP mesh, experts: expert-DP or expert-DP x ETP mesh; see the TRL report in docs) and, on
plain tensors, misses the experts held by the other EP ranks. Here each rank sums ``|g|^p`` over its local
data, weights every tensor by ``1 / (number of ranks holding the same values)``, and one all-reduce over the
world adds it all up:

    dense, DDP (plain or Replicate)             replicas = dp * tp    (identical on every rank)
    dense, DDP, TP-split (Replicate, Shard)     replicas = dp         (each TP rank holds its own slice)
    dense, FSDP2, TP-replicated (Shard, Repl.)  replicas = tp
    dense, FSDP2, TP-split (Shard, Shard)       replicas = 1          (each element on one rank)
    expert, DDP (replicated over expt_dp)       replicas = expt_dp    (EP and ETP ranks hold different slices)
    expert, FSDP2 (Shard over expt_dp)          replicas = 1

In general ``replicas = world / (mesh shards of the tensor) / (ep if expert else 1)``, with mesh shards the
product of the sizes of the mesh dims whose placement is ``Shard`` (or TP's ``_StridedShard``). Every rank
issues exactly one all-reduce (``max`` for the inf-norm), so a rank whose experts saw no token never skips a
collective.

The caller's dense / expert split decides the ``ep`` factor, and a wrapped model's gradients carry their mesh:
a DTensor gradient must live on the dense meshes (dimensions ``dp`` and ``tp``) or the expert ones
(``expt_dp`` and ``expt_tp``); under DDP with a one-rank expert-DP mesh, where both stay plain, an expert
parameter (``allreduce = False``) must not be in the dense list nor a dense one (``allreduce = True``) in the
expert list. So a parameter passed in the wrong list raises instead of silently changing the norm. A ``Partial``
gradient (not yet reduced) raises too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.process_groups import ProcessGroupCollection


def _local_and_shards(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not isinstance(grad, DTensor):
        return grad, 1
    shards = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
        if isinstance(placement, (Shard, _StridedShard)):
            shards *= size
        elif not placement.is_replicate():
            raise ValueError(f"grad placement {placement}: expected Shard or Replicate (reduce gradients first)")
    return grad.to_local(), shards


def _mesh_names(pg_collection: ProcessGroupCollection | None, expert: bool) -> list[tuple[str, ...]] | None:
    """The mesh dimension names a dense (``expert`` False) or expert gradient may live on; None: any."""
    if pg_collection is None:
        return None
    if expert:
        return [("expt_dp",)] + ([("expt_tp",), ("expt_dp", "expt_tp")] if pg_collection.expt_tp is not None else [])
    return [("dp",)] + ([("tp",), ("dp", "tp")] if pg_collection.tp is not None else [])


def _check_mesh(grad: torch.Tensor, names: list[tuple[str, ...]] | None, where: str) -> None:
    if names is not None and isinstance(grad, DTensor) and grad.device_mesh.mesh_dim_names not in names:
        raise ValueError(
            f"{where}: its gradient lives on mesh {grad.device_mesh.mesh_dim_names}, expected "
            f"{' or '.join(map(str, names))}; pass the parameters as split_expert_params splits them"
        )


def _check_mark(param: torch.nn.Parameter, expert: bool, where: str) -> None:
    """A plain parameter's DDP mark (``_check_mesh`` cannot see a plain tensor's mesh) must fit its list."""
    if getattr(param, "allreduce", None) is expert:
        kind = "a dense parameter (allreduce=True" if expert else "an expert parameter (allreduce=False"
        raise ValueError(f"{where}: {kind}, under DDP with a one-rank expert-DP mesh) in the "
                         f"{'expert' if expert else 'dense'} list; pass the parameters as split_expert_params "
                         "splits them")


def get_grad_norm(dense_params: Iterable[torch.nn.Parameter], expert_params: Iterable[torch.nn.Parameter],
                  pg_collection: ProcessGroupCollection | None, norm_type: float = 2.0) -> torch.Tensor:
    """Global ``norm_type``-norm of all gradients (fp32 scalar, identical on every rank).

    Args:
        dense_params / expert_params: this rank's parameters (plain or DTensor), split as
            ``split_expert_params`` splits them; grads of ``None`` count as 0.
        pg_collection: the process groups, or ``None`` for one process.
    Raises:
        ValueError: ``norm_type`` is not positive, a grad is still ``Partial``, or a DTensor grad is not on a
            mesh of its list (``dense_params[i]``: dimensions ``dp`` / ``tp``, ``expert_params[i]``:
            ``expt_dp`` / ``expt_tp``), or a parameter's ``allreduce`` mark (False: expert, True: dense) puts it in
            the other list; the message names the list and index. Other plain-tensor grads carry no mesh and are
            taken as split.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type: expected > 0 or inf, got {norm_type}")
    world = 1 if pg_collection is None else dist.get_world_size()
    ep = 1 if pg_collection is None else pg_collection.ep_size
    total = None
    for arg, params, expert in (("dense_params", dense_params, False), ("expert_params", expert_params, True)):
        per_rank_copies, mesh = (ep if expert else 1), _mesh_names(pg_collection, expert)
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            where = f"{arg}[{i}] (shape {tuple(p.shape)})"
            _check_mesh(p.grad, mesh, where)
            if pg_collection is not None:
                _check_mark(p, expert, where)
            local, shards = _local_and_shards(p.grad)
            # One read of the gradient, accumulated in float32.
            norm = torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float32)
            if total is None:
                total = torch.zeros((), dtype=torch.float32, device=local.device)
            if norm_type == float("inf"):
                total = torch.maximum(total, norm)
            else:
                replicas = world // (shards * per_rank_copies)
                total = total + norm.pow(norm_type) / replicas
    if total is None:
        total = torch.zeros((), dtype=torch.float32, device=_default_device(pg_collection))
    if pg_collection is not None and world > 1:
        op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
        with named_collective("all_reduce (global gradient norm)"):
            dist.all_reduce(total, op=op)
    return total if norm_type == float("inf") else total.pow(1.0 / norm_type)


def clip_grad_norm_(dense_params: Iterable[torch.nn.Parameter], expert_params: Iterable[torch.nn.Parameter],
                    max_norm: float, pg_collection: ProcessGroupCollection | None, norm_type: float = 2.0
                    ) -> torch.Tensor:
    """Scale all gradients in place so their global norm is at most ``max_norm``; return the norm before.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``
    clamped to 1), with the norm from ``get_grad_norm``, whose errors it raises before scaling anything.
    """
    dense_params, expert_params = list(dense_params), list(expert_params)
    total = get_grad_norm(dense_params, expert_params, pg_collection, norm_type)
    scale_grads_(dense_params + expert_params, clip_coefficient(total, max_norm))
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (total_norm + 1e-6), 1)``: the factor that brings the gradients' norm to at most
    ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s arithmetic)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def scale_grads_(params: Iterable[torch.nn.Parameter], coef: torch.Tensor) -> None:
    """Multiply every gradient (its local part, for DTensors) by the 0-dim ``coef`` in place."""
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.mul_(coef.to(local.device, local.dtype))


def _default_device(pg_collection: ProcessGroupCollection | None) -> torch.device:
    if pg_collection is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["clip_coefficient", "scale_grads_", "get_grad_norm", "clip_grad_norm_"]
