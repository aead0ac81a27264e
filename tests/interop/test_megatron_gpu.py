"""moe_core's Megatron-Core modules on a GPU (``pytest -m gpu tests/interop``), each in a harness rank on cuda:0:

- Megatron's ``MoELayer`` with ``MoECoreGroupedMLP``, and Megatron's ``TEGroupedMLP`` on moe_core's grouped linears
  (where megatron-core has the builder protocols: skipped elsewhere), against ``SequentialMLP`` in float64
  (tolerances: ``tests/interop/_megatron_parity.py``); the README's recipe as a whole ``GPTModel``.
- bf16 experts on dispatched rows (some experts empty): each output and gradient's error against float64 at most
  twice ``SequentialMLP``'s bf16 error (plus 1e-4 of slack).
- ``MoECoreGroupedMLP`` forward and backward run without a host sync (``torch.cuda.set_sync_debug_mode``), the
  counts on the GPU or on the host; with GPU counts ``TEGroupedMLP`` syncs (its ``tokens_per_expert.tolist()``):
  the negative control.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe import experts as megatron_experts  # noqa: E402
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection  # noqa: E402

from moe_core.interop.megatron import (  # noqa: E402
    MoECoreGroupedMLP,
    sequential_to_grouped_keys,
    te_grouped_mlp_with_moe_core_linears,
)
from tests.interop._megatron_env import DEADLINE_S, build, megatron_state, moe_config, moe_layer_spec  # noqa: E402
from tests.interop._megatron_parity import assert_layers_agree, megatron_layer_pair, tolerance  # noqa: E402
from tests.parallel._launch import close_pools, run_distributed  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
HAS_BUILDER_PROTOCOLS = hasattr(megatron_experts, "GroupedMLPSubmodules")
needs_builder_protocols = pytest.mark.skipif(not HAS_BUILDER_PROTOCOLS, reason="this megatron-core has no "
                                             "GroupedLinearFc1Builder / GroupedMLPSubmodules")


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    close_pools()


def _layer_parity(te_grouped_mlp: bool) -> None:
    with megatron_state(device=CUDA):
        torch.manual_seed(0)
        config = moe_config(CUDA, num_moe_experts=16, moe_router_topk=4)
        if te_grouped_mlp:
            reference, ours = megatron_layer_pair(config, te_grouped_mlp_with_moe_core_linears(),
                                                  sequential_to_grouped_keys)
        else:
            reference, ours = megatron_layer_pair(config)
        assert_layers_agree(reference, ours, torch.randn(16, 2, config.hidden_size, dtype=torch.float64, device=CUDA))


def test_moe_core_grouped_mlp_matches_sequential_mlp_on_gpu():
    run_distributed(1, _layer_parity, timeout=DEADLINE_S, te_grouped_mlp=False)


@needs_builder_protocols
def test_te_grouped_mlp_on_moe_core_linears_matches_sequential_mlp_on_gpu():
    run_distributed(1, _layer_parity, timeout=DEADLINE_S, te_grouped_mlp=True)


def _gpt_recipe() -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_core.interop.megatron import with_moe_core_experts

    with megatron_state(device=CUDA):
        config = moe_config(CUDA, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
        models = [GPTModel(config=config, transformer_layer_spec=s, vocab_size=64, max_sequence_length=32).to(CUDA)
                  for s in (spec, with_moe_core_experts(spec))]
        models[1].load_state_dict(models[0].state_dict())
        ids = torch.randint(0, 64, (2, 32), device=CUDA)
        positions = torch.arange(32, device=CUDA).expand(2, 32)
        losses = [m(ids, positions, attention_mask=None, labels=ids) for m in models]
        torch.testing.assert_close(losses[1], losses[0], **tolerance(CUDA))


def test_readme_recipe_gpt_matches_sequential_mlp():
    run_distributed(1, _gpt_recipe, timeout=DEADLINE_S)


def _bf16_errors() -> None:
    with megatron_state(device=CUDA):
        torch.manual_seed(0)
        shape = dict(hidden_size=256, moe_ffn_hidden_size=512, ffn_hidden_size=512, init_method_std=0.05)
        truth_config = moe_config(CUDA, **shape)
        bf16_config = moe_config(CUDA, params_dtype=torch.bfloat16, **shape)
        truth = build(moe_layer_spec(truth_config), config=truth_config).experts  # SequentialMLP
        with torch.no_grad():  # the same weights everywhere: bf16 values
            for p in truth.parameters():
                p.copy_(p.bfloat16())
        state = {k: v.bfloat16() if torch.is_tensor(v) else v for k, v in truth.state_dict().items()}
        sequential = build(moe_layer_spec(bf16_config), config=bf16_config).experts
        sequential.load_state_dict(state)
        ours = MoECoreGroupedMLP(8, bf16_config)
        ours.load_state_dict(state)
        counts = torch.tensor([300, 0, 517, 1, 0, 1024, 77, 129], device=CUDA)
        x = torch.randn(int(counts.sum()), 256, device=CUDA).bfloat16()
        probs, grad = torch.rand(x.shape[0], device=CUDA), torch.randn_like(x)
        results = {}
        for name, module in (("truth", truth), ("sequential", sequential), ("ours", ours)):
            x_in = x.to(module.config.params_dtype).detach().clone().requires_grad_()
            out, _ = module(x_in, counts, probs)
            out.backward(grad.to(out.dtype))
            results[name] = [out, x_in.grad, *_expert_weight_grads(module)]
        for i, (t, s, o) in enumerate(zip(results["truth"], results["sequential"], results["ours"], strict=True)):
            error_s, error_o = _relative_error(s, t), _relative_error(o, t)
            assert error_o <= 2 * error_s + 1e-4, (i, error_o, error_s)


def _expert_weight_grads(module) -> list[torch.Tensor]:
    if isinstance(module, MoECoreGroupedMLP):
        return [module.linear_fc1.weight.grad, module.linear_fc2.weight.grad]
    return [torch.stack([getattr(e, name).weight.grad for e in module.local_experts])
            for name in ("linear_fc1", "linear_fc2")]


def _relative_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    return float((value.double() - truth).norm() / truth.norm())


def test_bf16_error_at_most_twice_sequential_mlps():
    run_distributed(1, _bf16_errors, timeout=DEADLINE_S)


def _host_syncs(counts_device: str) -> None:
    with megatron_state(device=CUDA):
        config = moe_config(CUDA, params_dtype=torch.bfloat16, add_bias_linear=True)
        ours = MoECoreGroupedMLP(8, config)
        te = build(te_grouped_mlp_with_moe_core_linears(), 8, config, pg_collection=get_default_pg_collection())
        counts = torch.tensor([5, 0, 9, 1, 0, 12, 3, 2], device=counts_device)
        x = torch.randn(int(counts.sum()), config.hidden_size, device=CUDA, dtype=torch.bfloat16)
        probs = torch.rand(x.shape[0], device=CUDA)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = ours(x.requires_grad_(), counts, probs)
            out.backward(torch.ones_like(out))
            if counts_device == "cuda":
                with pytest.raises(RuntimeError, match="synchroniz"):
                    te(x, counts, probs)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("counts_device", ["cuda", "cpu"])  # cpu: as Megatron's all-to-all dispatcher hands them
def test_moe_core_grouped_mlp_never_syncs_the_host(counts_device):
    run_distributed(1, _host_syncs, timeout=DEADLINE_S, counts_device=counts_device)
