"""bench_dispatch's agreement check: ``max_difference`` measures how far a timed exchange's outputs and input
gradients lie from the eager one's, so a compiled or graphed exchange that computes something else shows."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_dispatch import max_difference  # noqa: E402


def _exchange(scale_out: float = 1.0, scale_probs: float = 1.0):
    """A stand-in exchange: combined rows from hidden and the probs, and per-row probs."""
    def forward(x, p, routing_map):
        return x * p.sum(dim=1, keepdim=True) * scale_out, p[routing_map] * scale_probs

    return forward


@pytest.mark.parametrize("expert", ["identity", "scale"])
def test_the_same_exchange_differs_by_nothing_and_another_one_shows(expert):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g)
    routing_map = torch.rand(6, 3, generator=g) > 0.5
    probs = torch.where(routing_map, torch.rand(6, 3, generator=g), 0.0)
    eager = _exchange()
    assert max_difference(_exchange(), eager, hidden, probs, routing_map, expert) == 0.0
    assert max_difference(_exchange(scale_out=1.5), eager, hidden, probs, routing_map, expert) > 0.1
    # The probs' output reaches the gradients only through identity's backward; its value counts in both.
    assert max_difference(_exchange(scale_probs=2.0), eager, hidden, probs, routing_map, expert) > 0.1
