"""Activation recompute: Megatron's ``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``
and ``--recompute-modules``, on ``torch.utils.checkpoint``.

- ``full``: whole transformer layers keep only their input and run again in backward. ``uniform`` checkpoints
  groups of ``recompute_num_layers`` consecutive layers (each group keeps its first input); ``block`` checkpoints
  the first ``recompute_num_layers`` layers one by one and leaves the rest.
- ``selective``: the parts ``recompute_modules`` names: ``core_attn`` (scaled dot-product attention), ``mlp`` (the
  dense MLP), ``moe`` (the whole MoE layer: router, dispatch with its collectives, experts, combine),
  ``shared_experts``, and the two whose outputs are recomputed where their consumer needs them, not kept
  (Megatron's ``CheckpointWithoutOutput``): ``layernorm`` (the outputs of both norms of a layer) and ``moe_act``
  (the experts' activation). Those two run eagerly only: inside a compiled layer the compiler's partitioner decides
  which elementwise results it keeps.

Recomputation reruns the same kernels on the same inputs with the RNG state of the first run, so gradients are
bitwise those of a run without recompute (tested on the CPU). State a forward mutates (the router's load counters)
is updated once: ``is_recomputing()`` is True while a forward runs again in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint

_recomputing = False  # a plain module global: a compiled function guards on its value


def is_recomputing() -> bool:
    """True while ``checkpoint`` reruns a forward in backward (eager runs; compiled graphs recompute pure ops)."""
    return _recomputing


@contextlib.contextmanager
def _recompute_phase() -> Iterator[None]:
    global _recomputing
    previous, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = previous


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _recompute_phase()


def checkpoint(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)`` keeping only ``args`` for backward, which runs ``fn`` again (non-reentrant
    ``torch.utils.checkpoint``, RNG state restored)."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)


_active: OutputRecompute | None = None


def recompute_output(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``, recomputed where a consumer saved it when an ``OutputRecompute`` is active (else kept)."""
    return fn(*inputs) if _active is None else _active.output(fn, *inputs)


class OutputRecompute:
    """Outputs recomputed where a consumer saved them (Megatron's ``CheckpointWithoutOutput``), for one forward.

    ``with recompute:`` around the forward whose consumers save the outputs; ``recompute.output(fn, *inputs)`` for
    each output. A tensor a consumer saves for backward that shares an output's storage (the output or a view of it)
    is stored as the recipe ``(fn, inputs, its view)`` instead and made again, without grad, when backward needs it.
    The inputs must be kept unmodified until then (they are: the norms' input is the residual stream, saved by the
    norm itself; the activation's input is fc1's output, saved by the activation). Off while compiling (the hooks
    cannot be traced): ``output`` then just calls ``fn``.
    """

    def __init__(self) -> None:
        self._recipes: dict[int, tuple[torch.Tensor, Callable, tuple]] = {}
        self._hooks = None

    def __enter__(self) -> OutputRecompute:
        global _active
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._outer
        self._hooks.__exit__(*exc)
        self._recipes.clear()  # the outputs may be freed now

    def output(self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        out = fn(*inputs)
        if type(out) is torch.Tensor and torch.is_grad_enabled():
            self._recipes[out.untyped_storage().data_ptr()] = (out, fn, inputs)
        return out

    def _pack(self, saved: torch.Tensor):
        if type(saved) is not torch.Tensor or saved.device.type == "meta":
            return saved
        recipe = self._recipes.get(saved.untyped_storage().data_ptr())
        if recipe is None or recipe[0].dtype != saved.dtype:
            return saved
        _, fn, inputs = recipe
        return _Recipe(fn, inputs, (saved.size(), saved.stride(), saved.storage_offset()))


class _Recipe:
    """How to make a saved tensor again: ``fn(*inputs)`` viewed as ``view`` (size, stride, storage offset)."""

    def __init__(self, fn: Callable, inputs: tuple, view: tuple):
        self.fn, self.inputs, self.view = fn, inputs, view


def _unpack(packed):
    if not isinstance(packed, _Recipe):
        return packed
    with torch.no_grad():
        full = packed.fn(*packed.inputs)
    return full.as_strided(*packed.view)


def full_recompute_groups(num_layers: int, method: str, num_recompute: int) -> list[tuple[int, int, bool]]:
    """``(start, stop, checkpointed)`` runs of layers for full recompute: ``uniform``, groups of ``num_recompute``
    layers, each checkpointed whole; ``block``, the first ``num_recompute`` layers checkpointed one by one, then
    the rest as one run without."""
    if method == "uniform":
        return [(i, min(i + num_recompute, num_layers), True) for i in range(0, num_layers, num_recompute)]
    first = min(num_recompute, num_layers)
    groups = [(i, i + 1, True) for i in range(first)]
    return groups + ([(first, num_layers, False)] if first < num_layers else [])


__all__ = ["is_recomputing", "checkpoint", "OutputRecompute", "recompute_output", "full_recompute_groups"]
