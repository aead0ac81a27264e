"""All-gather token dispatcher for expert parallelism (Megatron-LM's ``MoEAllGatherTokenDispatcher``).

Legend (docs/design.md): T this rank's tokens, T_max the most any EP rank passes, G = ep * T_max gathered tokens,
H hidden, E experts, L = E / ep local experts, R rows this rank's experts receive.

dispatch:  exchange each rank's T and rows per expert, copy to the host and wait  (the host sync)
           pad hidden [T, H], probs [T, E], routing_map [T, E] to T_max rows (routed nowhere), all-gather over EP
                                                                                  -> [G, ...]
           keep the local experts' columns, permute (sized by the exchanged counts) -> [R, H] grouped by local expert
combine:   unpermute (gather-sum) into [G, H], sum reduce-scatter, drop the padding -> [T, H]

EP ranks may pass different T, zero included; with drop_and_pad (each rank's tokens padded to its own capacity)
they must pass the same T, and every rank raises otherwise, naming each rank's T. Row order inside an expert is
(source rank, token index), the same as the all-to-all dispatcher's, so both feed the experts identical inputs.
One count exchange, three all-gathers in dispatch and one reduce-scatter in combine on every rank (mirrors in
backward); one host sync per dispatch, the counts' (an event wait on a copy queued behind the routing, not an
implicit sync), which also sizes the padding and ``permute``'s output. Under torch.compile both run eagerly, as the
all-to-all dispatcher's EP exchange does (its module docstring says why): the expert compute around them compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_core.moe.ep_counts import gather_counts, same_token_counts
from moe_core.moe.moe_utils import RowMap, permute, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.parallel.collectives import all_gather_first_dim, reduce_scatter_first_dim


@dataclass(frozen=True)
class AllGatherDispatchMeta:
    """What ``combine`` needs: the ``moe_utils.RowMap`` of the G gathered tokens, and this rank's T."""

    row_map: RowMap
    num_tokens: int


class MoEAllGatherTokenDispatcher(ExpertParallelTokenDispatcher):
    """Arguments: see ``ExpertParallelTokenDispatcher``; contract: ``MoETokenDispatcher``.

    Raises (dispatch): ``ValueError`` with drop_and_pad when the EP ranks pass different T.
    """

    @torch.compiler.disable
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """See ``MoETokenDispatcher.dispatch``: rows grouped by local expert, then source rank, then token index."""
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        num_tokens = hidden.shape[0]
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        # Per rank: its T, then its rows for each expert.
        local_counts = torch.cat([routing_map.new_full((1,), num_tokens, dtype=torch.int64), routing_map.sum(dim=0)])
        counts = gather_counts(local_counts, self.ep_group).wait()  # [ep][1 + E]
        token_counts = [row[0] for row in counts]
        if self.drop_and_pad:
            same_token_counts(token_counts, "moe_pad_expert_input_to_capacity with the allgather dispatcher")
        pad = max(token_counts) - num_tokens
        if pad:
            hidden, probs = F.pad(hidden, (0, 0, 0, pad)), F.pad(probs, (0, 0, 0, pad))
            routing_map = F.pad(routing_map, (0, 0, 0, pad), value=False)
        gathered_GH = all_gather_first_dim(hidden, self.ep_group)
        local_probs_GL = all_gather_first_dim(probs.float(), self.ep_group)[:, first:last]
        local_map_GL = all_gather_first_dim(routing_map, self.ep_group)[:, first:last]
        if self.drop_and_pad:
            # Each source rank padded every expert to its own capacity; the local experts see ep of them.
            num_out_tokens = self.capacity(num_tokens) * self.ep_size * self.num_local_experts
        else:
            num_out_tokens = sum(sum(row[1 + first:1 + last]) for row in counts)
        permuted_RH, permuted_probs_R, row_map = permute(
            gathered_GH, local_map_GL, probs=local_probs_GL, num_out_tokens=num_out_tokens,
            drop_and_pad=self.drop_and_pad, num_slots=None if self.drop_and_pad else min(self.topk,
                                                                                         self.num_local_experts),
        )
        if self.drop_and_pad:
            tokens_per_expert_L = torch.full(
                (self.num_local_experts,), num_out_tokens // self.num_local_experts, dtype=torch.int64,
                device=hidden.device,
            )
        else:
            tokens_per_expert_L = local_map_GL.sum(dim=0).to(torch.int64)
        meta = AllGatherDispatchMeta(row_map, num_tokens)
        return permuted_RH, tokens_per_expert_L, permuted_probs_R.float(), meta

    @torch.compiler.disable
    def combine(self, expert_output: torch.Tensor, meta: AllGatherDispatchMeta) -> torch.Tensor:
        """Sum each gathered token's rows of ``expert_output`` [R, H] (unpermute's gather-sum), then keep this rank's
        [T, H] sum over the EP ranks (reduce-scatter, padding dropped)."""
        out_GH = unpermute(expert_output, meta.row_map)
        return reduce_scatter_first_dim(out_GH, self.ep_group)[:meta.num_tokens]


__all__ = ["MoEAllGatherTokenDispatcher", "AllGatherDispatchMeta"]
