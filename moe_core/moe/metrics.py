"""Routing metrics: each router records its last training forward, the trainer asks for one report.

Legend (docs/design.md): L MoE layers, E experts, N losses a router computes.

Recording (``RoutingRecorder``, one per ``TopKRouter``) is in-place copies into fixed buffers, so it runs inside
compiled layers (``fullgraph``) and CUDA graphs (a buffer a graph writes keeps its address and its values past
the next step). A forward records only in training mode with gradients enabled; a forward run again in backward
(activation recompute) records the same values again, so the compiled forward and its recomputation stay one
graph apart by the router's load counter only.

Reporting (``routing_report``) reads every layer's record, reduces it over the ranks and returns plain numbers
(Megatron's ``MoEMetricsTracker`` does the same split: routers record, the training loop reports). It is
collective: every rank issues the same all-reduces whatever its data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.process_groups import ProcessGroupCollection

# Every loss a router may compute, in the order a recorder holds them.
LOSS_NAMES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")


class RoutingRecorder(nn.Module):
    """The last training forward of one router: rows per expert and raw losses, detached.

    Args:
        num_experts: E.
        loss_names: the losses the router computes (a subset of ``LOSS_NAMES``, in that order).

    Attributes:
        tokens_per_expert: ``[E]`` float32 buffer, rows routed per expert (after dropping) by this rank's tokens.
        losses: ``[N]`` float64 buffer, the raw losses (without their coefficients; a balanced router's
            load-balancing losses are 1.0), in ``loss_names`` order. Under TP each is this rank's share.
        Both are zeros before the first training forward, and stay float32 / float64 whatever the module is cast
        to. They are not part of the state dict.
    Raises:
        ValueError: a name of ``loss_names`` is not in ``LOSS_NAMES``.
    """

    def __init__(self, num_experts: int, loss_names: Sequence[str]):
        super().__init__()
        unknown = sorted(set(loss_names) - set(LOSS_NAMES))
        if unknown:
            raise ValueError(f"loss_names: expected names from {LOSS_NAMES}, got {unknown}")
        self.loss_names = tuple(name for name in LOSS_NAMES if name in loss_names)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("losses", torch.zeros(len(self.loss_names), dtype=torch.float64), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.tokens_per_expert = self.tokens_per_expert.float()
        self.losses = self.losses.double()
        return self

    @torch.no_grad()
    def record(self, tokens_per_expert_E: torch.Tensor, losses: dict[str, torch.Tensor]) -> None:
        """Keep ``tokens_per_expert_E`` (``[E]``) and ``losses`` (scalars keyed by every name of ``loss_names``)."""
        self.tokens_per_expert.copy_(tokens_per_expert_E)
        if self.loss_names:
            self.losses.copy_(torch.stack([losses[name].to(torch.float64) for name in self.loss_names]))

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The recorded losses by name: 0-dim float64 views of ``losses``."""
        return {name: self.losses[i] for i, name in enumerate(self.loss_names)}


@dataclass(frozen=True)
class RoutingReport:
    """What the MoE layers' last training forward routed, over all ranks.

    Attributes:
        layer_numbers: the L MoE layers' 0-based decoder layer numbers.
        tokens_per_expert: ``[L][E]`` rows per expert of every rank's tokens (the whole global micro-batch).
        losses: per loss name, its L per-layer raw values: summed over TP ranks (each holds its share), averaged
            over DP ranks (each computes the loss of its own tokens), as Megatron reports them.
        ep_load_imbalance: ``ep_load_imbalance`` of the layers' loads, None without EP.
    """

    layer_numbers: list[int]
    tokens_per_expert: list[list[float]]
    losses: dict[str, list[float]]
    ep_load_imbalance: float | None = None

    def metrics(self) -> dict:
        """The report as ``MetricsWriter`` values.

        Totals over layers: each loss (summed over layers), ``expert_load_min`` / ``expert_load_max`` (over
        all layers' experts), ``expert_load_cv`` (the mean over layers of the coefficient of variation of the
        layer's loads), ``dead_experts`` (experts with no rows, summed over layers) and ``ep_load_imbalance``
        under EP. Per layer, under ``moe`` -> ``layer_<number>``: ``load_min``, ``load_max``, ``load_cv``,
        ``dead_experts``, each loss, and ``tokens_per_expert`` (the E loads, a list).
        """
        loads_LE = torch.tensor(self.tokens_per_expert, dtype=torch.float64)
        cv_L = loads_LE.std(dim=1, unbiased=False) / loads_LE.mean(dim=1).clamp_min(1e-9)
        dead_L = (loads_LE == 0).sum(dim=1)
        totals = {name: sum(values) for name, values in self.losses.items()}
        totals.update(expert_load_min=loads_LE.min().item(), expert_load_max=loads_LE.max().item(),
                      expert_load_cv=cv_L.mean().item(), dead_experts=int(dead_L.sum()))
        if self.ep_load_imbalance is not None:
            totals["ep_load_imbalance"] = self.ep_load_imbalance
        layers = {}
        for i, number in enumerate(self.layer_numbers):
            layers[f"layer_{number}"] = {
                "load_min": loads_LE[i].min().item(), "load_max": loads_LE[i].max().item(),
                "load_cv": cv_L[i].item(), "dead_experts": int(dead_L[i]),
                **{name: values[i] for name, values in self.losses.items()},
                "tokens_per_expert": self.tokens_per_expert[i],
            }
        return {**totals, "moe": layers}


def routing_report(layers: Sequence[nn.Module], pg_collection: ProcessGroupCollection | None = None,
                   layer_numbers: Sequence[int] | None = None) -> RoutingReport | None:
    """Reduce the ``MoELayer`` s' records over the ranks; None when ``layers`` is empty.

    Args:
        layers: the MoE layers in depth order (``GPTModel.moe_layers()``), each with a ``router.recorder``.
        pg_collection: the ranks' groups, None for one process. Collective: one all-reduce over ``tp_dp``,
            and under EP one over the EP group (and one over the ETP group at ETP > 1).
        layer_numbers: the layers' decoder layer numbers; None: ``0 .. L-1``.
    Raises:
        ValueError: ``layer_numbers`` does not hold one number per layer.
    """
    if not layers:
        return None
    numbers = list(range(len(layers))) if layer_numbers is None else list(layer_numbers)
    if len(numbers) != len(layers):
        raise ValueError(f"layer_numbers: expected {len(layers)} numbers (one per MoE layer), got {len(numbers)}")
    records = [layer.router.recorder for layer in layers]
    loads_LE = torch.stack([r.tokens_per_expert for r in records])
    losses_LN = torch.stack([r.losses for r in records])
    imbalance = None
    if pg_collection is not None and pg_collection.ep_size > 1:
        imbalance = ep_load_imbalance(loads_LE, pg_collection)
    flat = torch.cat([loads_LE.double().flatten(), losses_LN.flatten()])
    if pg_collection is not None:
        with named_collective("all_reduce (routing report)", pg_collection.tp_dp):
            dist.all_reduce(flat, group=pg_collection.tp_dp)
    flat = flat.cpu()
    num_loads = loads_LE.numel()
    losses_NL = (flat[num_loads:].view(losses_LN.shape) / (pg_collection.dp_size if pg_collection else 1)).t()
    return RoutingReport(
        layer_numbers=numbers, tokens_per_expert=flat[:num_loads].view(loads_LE.shape).tolist(),
        losses=dict(zip(records[0].loss_names, losses_NL.tolist(), strict=True)), ep_load_imbalance=imbalance,
    )


def ep_load_imbalance(loads_LE: torch.Tensor, pg_collection: ProcessGroupCollection) -> float:
    """Rows the busiest EP rank's experts received over the EP ranks' mean, averaged over MoE layers: 1.0 when
    balanced. Every all-to-all waits for the busiest rank, so the experts' share of an EP step takes about this
    factor longer than balanced loads would.

    Args:
        loads_LE: ``[L, E]`` this rank's rows per expert (its tokens only), any float or int dtype.
        pg_collection: the groups; a rank's rows are its local experts' loads summed over the EP group's tokens
            (and the ETP group's, whose tokens every ETP rank runs): the ranks at this rank's TP position.
            Collective over the EP group (and the ETP group at ETP > 1): one all-reduce each.
    """
    loads = loads_LE.float().clone()
    for group in (pg_collection.ep, pg_collection.expt_tp):
        if group is not None:
            with named_collective("all_reduce (EP load imbalance)", group):
                dist.all_reduce(loads, group=group)
    rows = loads.view(loads.shape[0], pg_collection.ep_size, -1).sum(dim=2)  # [L, EP ranks]
    return (rows.max(dim=1).values / rows.mean(dim=1).clamp_min(1e-9)).mean().item()


__all__ = ["LOSS_NAMES", "RoutingRecorder", "RoutingReport", "routing_report", "ep_load_imbalance"]
