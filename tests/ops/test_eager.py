"""EagerOp: the Python custom ops' eager entry point (an autograd.Function over the op's own implementation and
autograd formula) against the registered op: which path runs where, and bitwise-equal outputs and gradients on
both, on the CPU and (marked gpu) on CUDA, where the implementation is the Triton kernels.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_core.ops import pack, permute, swiglu
from tests.ops.test_permute import random_maps


def _calls(device: str):
    """``(name, EagerOp, args, indices of the differentiable args)`` for every op with an eager entry point."""
    g = torch.Generator().manual_seed(0)
    token_of_row, row_of_slot = random_maps(13, 3, 6, seed=1, device=device)
    rows = token_of_row.shape[0]
    x = torch.randn(13, 40, generator=g).to(device)
    y = torch.randn(rows, 40, generator=g).to(device)
    values = torch.randn(rows, 2, generator=g).to(device)
    index, inverse = token_of_row.unsqueeze(1), row_of_slot
    packed = pack.pack_rows(x, values, index, inverse)
    fc1 = torch.randn(rows, 64, generator=g).to(device)
    probs = torch.rand(rows, generator=g).to(device)
    f32 = torch.float32
    return [
        ("permute_rows", permute._PERMUTE_ROWS, (x, token_of_row, row_of_slot, f32), (0,)),
        ("unpermute_rows", permute._UNPERMUTE_ROWS, (y, token_of_row, row_of_slot, f32), (0,)),
        ("pack_rows", pack._PACK_ROWS, (x, values, index, inverse, f32), (0, 1)),
        ("unpack_rows", pack._UNPACK_ROWS, (packed, inverse, index, 40, 2, f32), (0,)),
        ("swiglu_with_probs", swiglu._SWIGLU, (fc1, probs, None), (0, 1)),
        ("swiglu_with_probs", swiglu._SWIGLU, (fc1, probs, torch.tensor(rows, device=device)), (0, 1)),
    ]


def _run(fn, args, grad_args):
    args = [a.detach().requires_grad_() if i in grad_args else a for i, a in enumerate(args)]
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    seeds = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, [args[i] for i in grad_args], seeds)
    return outs, grads, outs[0].grad_fn


def _check(device: str):
    for name, eager_op, args, grad_args in _calls(device):
        outs, grads, grad_fn = _run(eager_op, args, grad_args)
        ref_outs, ref_grads, ref_grad_fn = _run(eager_op.op, args, grad_args)
        assert type(grad_fn).__name__.startswith(f"{name}_function"), (name, type(grad_fn))
        assert not type(ref_grad_fn).__name__.startswith(f"{name}_function"), (name, type(ref_grad_fn))
        for got, want in zip((*outs, *grads), (*ref_outs, *ref_grads), strict=True):
            assert torch.equal(got, want), name


def test_eager_entry_matches_the_op():
    _check("cpu")


@pytest.mark.gpu
def test_eager_entry_matches_the_op_cuda():
    _check("cuda")


class _Refuse:
    """Stands in for the path a call must not take."""

    def __call__(self, *args):
        raise AssertionError("the op was called where the eager Function should run")

    def apply(self, *args):
        raise AssertionError("the eager Function was called where the op should run")


def test_plain_tensors_take_the_function_and_traced_ones_the_op(monkeypatch):
    _, eager_op, args, _ = _calls("cpu")[0]
    with monkeypatch.context() as patch:
        patch.setattr(eager_op, "op", _Refuse())
        eager_op(*args)
    with monkeypatch.context() as patch:
        patch.setattr(eager_op, "function", _Refuse())
        with pytest.raises(AssertionError, match="eager Function"):
            eager_op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = eager_op(*fake_args)
        assert out.shape == (args[1].shape[0], args[0].shape[1])


def test_compiled_calls_take_the_op():
    _, eager_op, args, _ = _calls("cpu")[0]
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(lambda *a: eager_op(*a), backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(*args), eager_op(*args), rtol=0, atol=0)
    assert any("moe_core.permute_rows" in target for target in seen), seen
