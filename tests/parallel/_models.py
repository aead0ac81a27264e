"""Tiny MoE models with forced routing for the EP tests, and their single-process references.

G global tokens, N tokens of one rank, H hidden, E experts, L local experts, k topk.

Routing is a pure function of the global token id and of the rank that owns the token (``forced_routing``),
so "one rank receives zero tokens" is exact and the single-process reference routes identically. The router
weight still receives gradients: probs = softmax(router(x)) restricted to the forced experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from moe_core.config import TransformerConfig
from moe_core.moe.alltoall_expert_rows import ExpertRowsAlltoAllDispatcher
from moe_core.moe.capacity import apply_token_dropping, get_capacity
from moe_core.moe.dispatcher_factory import EP_DISPATCHERS
from moe_core.parallel.fsdp import ModelParts

# "alltoall_expert_rows": one row per (token, expert) whatever the config (the layout kept for drop_and_pad).
DISPATCHERS = {**EP_DISPATCHERS, "alltoall_expert_rows": ExpertRowsAlltoAllDispatcher}
GLOBAL_TOKENS = 24
NUM_EXPERTS = 8
# Capacity settings the EP tests sweep: none, dropping, and drop_and_pad (static shapes).
CAPACITY = {
    None: {},
    "drop": {"moe_expert_capacity_factor": 1.0},
    "pad": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
}


@dataclass(frozen=True)
class Scenario:
    """A routing of the global batch (see ``forced_routing``); ``empty_rank`` holds no tokens at all."""

    name: str
    topk: int = 2
    empty_rank: int | None = None


SCENARIOS = {
    "balanced": Scenario("balanced"),
    "dirichlet": Scenario("dirichlet"),
    "disjoint": Scenario("disjoint"),
    "recv_zero": Scenario("recv_zero"),
    "send_zero": Scenario("send_zero", empty_rank=1),
    "one_expert": Scenario("one_expert", topk=1),
}


def make_config(num_experts: int = 8, topk: int = 2, hidden: int = 16, ep: int = 1, **kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=hidden, num_moe_experts=num_experts,
        moe_router_topk=topk, moe_ffn_hidden_size=hidden, expert_model_parallel_size=ep, **kw,
    )


def token_counts(scenario: Scenario, global_tokens: int, world: int) -> list[int]:
    """Tokens per rank; the global batch is split contiguously in rank order."""
    if scenario.empty_rank is None or world == 1:
        return [global_tokens // world] * world
    holders = world - 1
    counts = [global_tokens // holders] * world
    counts[scenario.empty_rank] = 0
    return counts


def forced_routing(scenario: Scenario, global_tokens: int, world: int, ep: int, num_experts: int) -> torch.Tensor:
    """routing_map ``[G, E]`` bool of the whole global batch (same on every rank and in the reference)."""
    k, num_local = scenario.topk, num_experts // ep
    counts = token_counts(scenario, global_tokens, world)
    owner = torch.repeat_interleave(torch.arange(world), torch.tensor(counts))  # [G] rank of each token
    t = torch.arange(global_tokens)
    j = torch.arange(k)
    if scenario.name in ("balanced", "send_zero"):
        experts = (t[:, None] * k + j) % num_experts
    elif scenario.name == "dirichlet":
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            weights = torch.distributions.Dirichlet(torch.full((num_experts,), 0.3)).sample()
            experts = torch.multinomial(weights.expand(global_tokens, -1) + 1e-6, k)
    elif scenario.name == "disjoint":
        # Split the experts into one block per rank: tokens of rank r only visit block (r + 1) % world, which
        # lives on one EP rank (the next one when ep == world).
        per_block = num_experts // world
        target = (owner + 1) % world
        experts = target[:, None] * per_block + (t[:, None] + j) % per_block
    elif scenario.name == "recv_zero":
        # Every token goes to EP rank 0's experts: EP ranks 1.. receive nothing.
        experts = (t[:, None] + j) % num_local
    elif scenario.name == "one_expert":
        experts = torch.zeros(global_tokens, k, dtype=torch.long)
    else:
        raise ValueError(f"scenario: unknown {scenario.name!r}")
    routing_map = torch.zeros(global_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, experts, True)
    if int(routing_map.sum(1).min()) != k:
        raise AssertionError(f"{scenario.name}: a token got fewer than {k} distinct experts")
    return routing_map


def forced_probs(logits: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """softmax over each token's forced experts, 0 elsewhere; float32, differentiable in ``logits``."""
    return torch.softmax(logits.float().masked_fill(~routing_map, float("-inf")), dim=-1)


class ToyExperts(nn.Module):
    """``y = (x @ weight[e]) * prob`` for each local expert e; runs every expert, empty ones included. Rows past
    the counts' sum (the sync-free dispatch's unused rows) give NaN, standing in for the memory the grouped GEMM
    leaves unwritten there: nothing downstream may read them.

    ``weight`` [L, H, H]. Stands in for GroupedMLP where the test is about the communication.
    """

    def __init__(self, num_local_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_local_experts, hidden, hidden) * 0.3)

    def forward(self, x, tokens_per_expert, probs):
        counts = tokens_per_expert.tolist()
        *chunks, padding = torch.split(x, counts + [x.shape[0] - sum(counts)])
        out = torch.cat([c @ self.weight[e] for e, c in enumerate(chunks)] + [torch.full_like(padding, torch.nan)])
        return out * probs.unsqueeze(-1).to(out.dtype), None


class NaiveExperts(nn.Module):
    """NEGATIVE CONTROL: one nn.Linear per expert, skipping experts without tokens (the pattern of the
    transformers FSDP2 report). Their weights get no gradient at all on a rank whose tokens avoid them."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(num_experts))

    def forward(self, x, probs, routing_map):
        out = torch.zeros_like(x)
        for e, linear in enumerate(self.linears):
            rows = routing_map[:, e].nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, linear(x[rows]) * probs[rows, e, None])
        return out


class ToyMoE(nn.Module):
    """Router + dispatcher + experts; ``dispatcher=None`` computes the reference densely over all experts."""

    def __init__(self, config, pg_collection=None, dispatcher: str | None = "alltoall", ep_rank: int = 0):
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_moe_experts
        num_local = config.num_local_experts if dispatcher not in (None, "naive") else num_experts
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = NaiveExperts(num_experts, hidden) if dispatcher == "naive" else ToyExperts(num_local, hidden)
        self.naive = dispatcher == "naive"
        self.topk = config.moe_router_topk
        self.capacity_factor = config.moe_expert_capacity_factor
        self.pad = config.moe_pad_expert_input_to_capacity
        self.dispatcher = None
        if dispatcher not in (None, "naive"):
            local = list(range(ep_rank * num_local, (ep_rank + 1) * num_local))
            self.dispatcher = DISPATCHERS[dispatcher](num_local, local, config, pg_collection)

    def forward(self, x, routing_map, rank_counts: list[int] | None = None):
        """``rank_counts``: tokens per rank when the reference runs the global batch (dropping is per rank)."""
        probs = forced_probs(self.router(x), routing_map)
        if self.capacity_factor is not None:
            counts = rank_counts or [x.shape[0]]
            dropped = [
                apply_token_dropping(p, m, get_capacity(m.shape[0] * self.topk, m.shape[1], self.capacity_factor),
                                     pad_to_capacity=self.pad)
                for p, m in zip(probs.split(counts), routing_map.split(counts), strict=True)
            ]
            probs = torch.cat([p for p, _ in dropped])
            routing_map = torch.cat([m for _, m in dropped])
        self.last_routing_map = routing_map.detach()
        if self.naive:
            return self.experts(x, probs, routing_map)
        if self.dispatcher is None:
            y = torch.einsum("nh,ehk->nek", x, self.experts.weight)  # [N, E, H]
            return (y * probs.unsqueeze(-1)).sum(1)
        permuted, tokens_per_expert, permuted_probs, meta = self.dispatcher.dispatch(x, probs, routing_map)
        out, _ = self.experts(permuted, tokens_per_expert, permuted_probs)
        return self.dispatcher.combine(out, meta)


class ToyBlock(nn.Module):
    def __init__(self, config, pg_collection, dispatcher, ep_rank):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size)
        self.moe = ToyMoE(config, pg_collection, dispatcher, ep_rank)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, routing_map):
        x = x + self.moe(self.norm(x), routing_map)
        return x + torch.tanh(self.dense(x))


class ToyModel(nn.Module):
    """Blocks of (RMSNorm, MoE, dense) and a head; per-token loss = mean of squared outputs."""

    def __init__(self, config, pg_collection=None, dispatcher: str | None = "alltoall", ep_rank: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(
            ToyBlock(config, pg_collection, dispatcher, ep_rank) for _ in range(config.num_layers)
        )
        self.head = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, routing_map):
        for layer in self.layers:
            x = layer(x, routing_map)
        return self.head(x)


def toy_parts(model: ToyModel) -> ModelParts:
    """The blocks and experts of a ``ToyModel``, for the data-parallel wrappers."""
    return ModelParts(blocks=tuple(model.layers), experts=tuple(block.moe.experts for block in model.layers))


def per_token_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean(-1)


def reference_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (all-experts) parameters, identical on every rank."""
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in ToyModel(config, dispatcher=None).state_dict().items()}


def is_expert_name(name: str) -> bool:
    return ".experts." in f".{name}"


def naive_state(full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``full_state`` with each expert's [H, H] weight as the (transposed) weight of its nn.Linear."""
    state = {}
    for k, v in full_state.items():
        if k.endswith("experts.weight"):
            for e in range(v.shape[0]):
                state[k.replace("experts.weight", f"experts.linears.{e}.weight")] = v[e].t().contiguous()
        else:
            state[k] = v
    return state


def load_ep_slice(model: nn.Module, full_state: dict[str, torch.Tensor], ep_rank: int, num_local: int) -> None:
    """Copy ``full_state`` into an EP model: expert tensors take this rank's rows ``[ep_rank * L, +L)``."""
    state = {
        k: v[ep_rank * num_local:(ep_rank + 1) * num_local] if is_expert_name(k) else v for k, v in full_state.items()
    }
    model.load_state_dict(state)
