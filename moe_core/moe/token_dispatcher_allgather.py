"""All-gather token dispatcher for expert parallelism (Megatron-LM's ``MoEAllGatherTokenDispatcher``).

N local tokens (the same N on every EP rank), H hidden, E experts, L = E / ep local experts.

dispatch:  all-gather hidden [N, H], probs [N, E], routing_map [N, E] over EP -> [ep * N, ...]
           keep the local experts' columns, permute                          -> [R, H] grouped by local expert
combine:   unpermute (scatter-add) into [ep * N, H], sum reduce-scatter      -> [N, H]

Row order inside an expert is (source rank, token index), the same as ``MoEAlltoAllTokenDispatcher``, so
both feed the experts identical inputs. Three all-gathers in dispatch and one reduce-scatter in combine on
every rank (mirrors in backward); tokens_per_expert stays on the device, so the dispatcher itself needs no
host sync (``permute`` may, to size its output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.moe.moe_utils import RowMap, permute, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.parallel.collectives import all_gather_first_dim, reduce_scatter_first_dim


@dataclass(frozen=True)
class AllGatherDispatchMeta:
    """What ``combine`` needs: the row map of the gathered tokens (``moe_utils.RowMap``)."""

    row_map: RowMap


class MoEAllGatherTokenDispatcher(ExpertParallelTokenDispatcher):
    """Same arguments and contract as ``MoEAlltoAllTokenDispatcher``; every EP rank must pass the same N."""

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """See ``MoEAlltoAllTokenDispatcher.dispatch``."""
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        gathered = all_gather_first_dim(hidden, self.ep_group)  # [ep * N, H]
        local_probs = all_gather_first_dim(probs.float(), self.ep_group)[:, first:last]  # [ep * N, L]
        local_map = all_gather_first_dim(routing_map, self.ep_group)[:, first:last]  # [ep * N, L]
        num_out_tokens = None
        if self.drop_and_pad:
            # Each source rank padded every expert to its own capacity; the local experts see ep of them.
            num_out_tokens = self.capacity(hidden.shape[0]) * self.ep_size * self.num_local_experts
        permuted, permuted_probs, row_map = permute(
            gathered, local_map, probs=local_probs, num_out_tokens=num_out_tokens, drop_and_pad=self.drop_and_pad,
            num_slots=None if self.drop_and_pad else min(self.topk, self.num_local_experts),
        )
        if self.drop_and_pad:
            tokens_per_expert = torch.full(
                (self.num_local_experts,), num_out_tokens // self.num_local_experts, dtype=torch.int64,
                device=hidden.device,
            )
        else:
            tokens_per_expert = local_map.sum(dim=0).to(torch.int64)
        meta = AllGatherDispatchMeta(row_map)
        return permuted, tokens_per_expert, permuted_probs.float(), meta

    def combine(self, expert_output: torch.Tensor, meta: AllGatherDispatchMeta) -> torch.Tensor:
        """Sum ``expert_output`` [R, H] into the gathered tokens, then keep this rank's [N, H] sum."""
        out = unpermute(expert_output, meta.row_map)
        return reduce_scatter_first_dim(out, self.ep_group)


__all__ = ["MoEAllGatherTokenDispatcher", "AllGatherDispatchMeta"]
