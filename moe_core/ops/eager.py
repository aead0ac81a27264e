"""One Python custom op, two entry points: the op itself under ``torch.compile``, an ``autograd.Function`` in eager.

A ``torch.library.custom_op`` with ``register_autograd`` is what makes the Triton-backed ops traceable (schema,
fake kernel, an autograd formula AOTAutograd sees). In eager mode its Python dispatch and autograd wrapper cost
several times the kernel launch itself on the host (``docs/design.md``), and the MoE data path calls several
such ops per layer where small layers and the expert-parallel exchange are host-bound. ``EagerOp`` builds a
``torch.autograd.Function`` from the op's own implementation, ``setup_context`` and ``backward``, so the formula is
written once; ``__call__`` takes the Function for plain tensors in eager mode (the implementation alone where grad
mode is off, as in a backward pass without ``create_graph``) and the op otherwise: under ``torch.compile``, while
AOTAutograd or ``make_fx`` trace (fake and functional tensors), and for tensor subclasses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class EagerOp:
    """Calls ``op`` (``torch.ops.moe_core.<name>``) when tracing or given tensor subclasses, else the same
    implementation through a ``torch.autograd.Function`` with the op's autograd formula.

    Args:
        op: the registered custom op (its ``OpOverloadPacket``).
        impl: the function registered as the op's implementation, called with the op's arguments.
        setup_context / backward: the functions given to the op's ``register_autograd``; None for an op without
            autograd, which then runs as the op where grad mode is on (it refuses to be differentiated rather than
            return results without a graph). Where grad mode is off, ``impl`` runs directly either way.
    """

    def __init__(self, op, impl: Callable, setup_context: Callable | None = None, backward: Callable | None = None):
        self.op, self.impl = op, impl
        self.function = None if backward is None else _function(impl, setup_context, backward)

    def __call__(self, *args):
        if torch.compiler.is_compiling() or any(type(a) is not torch.Tensor for a in args
                                                if isinstance(a, torch.Tensor)):
            return self.op(*args)
        if not torch.is_grad_enabled():
            return self.impl(*args)
        return self.op(*args) if self.function is None else self.function.apply(*args)


def _function(impl: Callable, setup_context: Callable, backward: Callable) -> type[torch.autograd.Function]:
    # The classic form, ``forward(ctx, *args)``: a Function with a separate ``setup_context`` takes torch's
    # functorch-compatible path, which costs more host time than the custom op it replaces.
    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    return type(f"{impl.__name__.strip('_')}_function", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


__all__ = ["EagerOp"]
