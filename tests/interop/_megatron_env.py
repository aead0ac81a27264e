"""What the Megatron-Core tests share: Megatron's parallel state over the harness's process group, its MoE layer
built from its own spec, and configs.

Megatron's MoE path assumes CUDA in four places, none of them arithmetic: the all-to-all dispatcher makes a
``torch.cuda.Stream`` for its device-to-host copies, which turn the split sizes into numpy arrays only for GPU
tensors (a CPU tensor reaches ``all_to_all_single``, which refuses it), the router moves a CPU weight to
``torch.cuda.current_device()``, and without TransformerEngine the pinned megatron-core leaves ``te_general_gemm``
undefined in ``moe_utils`` (a NameError in the router). For CPU tensors ``megatron_state`` points them at the
host (streams and events that do nothing, host copies that give numpy arrays as the device-to-host ones do, the
CPU as the current device) and defines ``te_general_gemm`` as None, as newer releases do. Run inside a harness
rank (``tests/parallel/_launch.py``), so none of it outlives the test function. The device is the harness's
(the CPU on gloo, the rank's GPU on NCCL) unless a test names one.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.parallel._launch import device as harness_device

# A harness run's deadline: a fresh rank imports megatron-core first (about 10 s on an idle CPU).
DEADLINE_S = 180.0


class _HostEvent:
    def synchronize(self) -> None:
        pass


class _HostStream:
    def wait_stream(self, stream) -> None:
        pass

    def record_event(self) -> _HostEvent:
        return _HostEvent()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


@contextlib.contextmanager
def _cuda_calls_on_host():
    stream = _HostStream()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.multiple(
            torch.cuda, Stream=lambda *args, **kwargs: stream, current_stream=lambda *args, **kwargs: stream,
            stream=lambda s: contextlib.nullcontext(), current_device=lambda: torch.device("cpu")))
        stack.enter_context(mock.patch.object(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None))
        stack.enter_context(mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host))
        if not hasattr(moe_utils, "te_general_gemm"):
            stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        yield


@contextlib.contextmanager
def megatron_state(expert_model_parallel_size: int = 1, device: torch.device | None = None):
    """Megatron's ``parallel_state`` over the default process group (EP carved out of it) for modules on
    ``device``, torn down on exit."""
    on_host = (device or harness_device()).type == "cpu"
    with _cuda_calls_on_host() if on_host else contextlib.nullcontext():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_model_parallel_size)
        try:
            if not on_host:
                model_parallel_cuda_manual_seed(1234)  # Megatron initialises GPU weights under its RNG tracker
            yield
        finally:
            parallel_state.destroy_model_parallel()


def moe_config(device: torch.device | None = None, **overrides) -> TransformerConfig:
    """A small float64 MoE config for modules on ``device``: 8 experts top-2, hidden 16, SwiGLU experts of width
    24, no aux loss."""
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=24, ffn_hidden_size=24, gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                  moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp64",
                  params_dtype=torch.float64, init_method_std=0.3,
                  use_cpu_initialization=(device or harness_device()).type == "cpu")
    fields.update(overrides)
    return TransformerConfig(**fields)


def build(spec, *args, **kwargs):
    """Build a module from a Megatron spec: a ``ModuleSpec`` (``build_module``) or a ``functools.partial``."""
    return spec(*args, **kwargs) if isinstance(spec, functools.partial) else build_module(spec, *args, **kwargs)


def moe_layer_spec(config: TransformerConfig):
    """Megatron's local (no TransformerEngine) MoE spec: ``SequentialMLP`` experts."""
    return get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
