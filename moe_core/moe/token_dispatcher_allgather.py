"""All-gather token dispatcher for expert parallelism (Megatron-LM's ``MoEAllGatherTokenDispatcher``).

Legend (docs/design.md): T this rank's tokens (the same T on every EP rank), G = ep * T gathered tokens,
H hidden, E experts, L = E / ep local experts, R rows this rank's experts receive.

dispatch:  all-gather hidden [T, H], probs [T, E], routing_map [T, E] over EP -> [G, ...]
           keep the local experts' columns, permute                          -> [R, H] grouped by local expert
combine:   unpermute (gather-sum) into [G, H], sum reduce-scatter           -> [T, H]

Row order inside an expert is (source rank, token index), the same as ``MoEAlltoAllTokenDispatcher``, so
both feed the experts identical inputs. Three all-gathers in dispatch and one reduce-scatter in combine on
every rank (mirrors in backward); tokens_per_expert stays on the device, so the dispatcher itself needs no
host sync. ``permute`` needs one to size its output, unless ``moe_dispatch_sync_free`` sizes it for the worst case,
G * min(K, L) rows, the rows past ``tokens_per_expert``'s sum unused (prob 0; the grouped GEMM never reads
them). Under torch.compile both run eagerly, as the all-to-all dispatcher's EP exchange does (its module docstring
says why): the expert compute around them compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.moe.moe_utils import RowMap, permute, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.parallel.collectives import all_gather_first_dim, reduce_scatter_first_dim


@dataclass(frozen=True)
class AllGatherDispatchMeta:
    """What ``combine`` needs: the ``moe_utils.RowMap`` of the G gathered tokens."""

    row_map: RowMap


class MoEAllGatherTokenDispatcher(ExpertParallelTokenDispatcher):
    """Same arguments and contract as ``MoEAlltoAllTokenDispatcher``; every EP rank must pass the same T."""

    @torch.compiler.disable
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """See ``MoEAlltoAllTokenDispatcher.dispatch``."""
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        gathered_GH = all_gather_first_dim(hidden, self.ep_group)
        local_probs_GL = all_gather_first_dim(probs.float(), self.ep_group)[:, first:last]
        local_map_GL = all_gather_first_dim(routing_map, self.ep_group)[:, first:last]
        num_out_tokens = max_out_tokens = None
        if self.drop_and_pad:
            # Each source rank padded every expert to its own capacity; the local experts see ep of them.
            num_out_tokens = self.capacity(hidden.shape[0]) * self.ep_size * self.num_local_experts
        elif self.config.moe_dispatch_sync_free:
            max_out_tokens = gathered_GH.shape[0] * min(self.topk, self.num_local_experts)
        permuted_RH, permuted_probs_R, row_map = permute(
            gathered_GH, local_map_GL, probs=local_probs_GL, num_out_tokens=num_out_tokens,
            max_out_tokens=max_out_tokens, drop_and_pad=self.drop_and_pad,
            num_slots=None if self.drop_and_pad else min(self.topk, self.num_local_experts),
        )
        if self.drop_and_pad:
            tokens_per_expert_L = torch.full(
                (self.num_local_experts,), num_out_tokens // self.num_local_experts, dtype=torch.int64,
                device=hidden.device,
            )
        else:
            tokens_per_expert_L = local_map_GL.sum(dim=0).to(torch.int64)
        meta = AllGatherDispatchMeta(row_map)
        return permuted_RH, tokens_per_expert_L, permuted_probs_R.float(), meta

    @torch.compiler.disable
    def combine(self, expert_output: torch.Tensor, meta: AllGatherDispatchMeta) -> torch.Tensor:
        """Sum each gathered token's rows of ``expert_output`` [R, H] (unpermute's gather-sum), then keep this rank's
        [T, H] sum over the EP ranks (reduce-scatter)."""
        out_GH = unpermute(expert_output, meta.row_map)
        return reduce_scatter_first_dim(out_GH, self.ep_group)


__all__ = ["MoEAllGatherTokenDispatcher", "AllGatherDispatchMeta"]
