"""State dicts of ``MoECoreGroupedMLP``: Megatron ``TEGroupedMLP``'s keys (TransformerEngine ``GroupedLinear``'s
per-expert ``weight<e>`` / ``bias<e>``, [out, in] each) over one stacked parameter, bitwise round trips, and
loading the layouts Megatron writes (TEGroupedMLP's, TE's single grouped weight, SequentialMLP's keys).
Loading a real ``SequentialMLP``'s state dict is also what every parity test does."""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_core.interop.megatron import MoECoreGroupedMLP, sequential_to_grouped_keys  # noqa: E402
from tests.interop._megatron_env import moe_config  # noqa: E402

L, H, F = 4, 16, 24  # local experts, hidden, moe_ffn_hidden_size (SwiGLU: fc1 gives 2F)


def experts(seed: int = 0, **config) -> MoECoreGroupedMLP:
    torch.manual_seed(seed)
    return MoECoreGroupedMLP(L, moe_config(**config))


def te_layout(seed: int, bias: bool) -> dict:
    """A state dict as Megatron's TEGroupedMLP writes it: per-expert tensors and TE's (empty: no FP8) extra state."""
    g = torch.Generator().manual_seed(seed)
    state = {"linear_fc1._extra_state": torch.empty(0, dtype=torch.uint8),
             "linear_fc2._extra_state": torch.empty(0, dtype=torch.uint8)}
    for e in range(L):
        state[f"linear_fc1.weight{e}"] = torch.randn(2 * F, H, generator=g, dtype=torch.float64)
        state[f"linear_fc2.weight{e}"] = torch.randn(H, F, generator=g, dtype=torch.float64)
        if bias:
            state[f"linear_fc1.bias{e}"] = torch.randn(2 * F, generator=g, dtype=torch.float64)
            state[f"linear_fc2.bias{e}"] = torch.randn(H, generator=g, dtype=torch.float64)
    return state


def assert_holds(module: MoECoreGroupedMLP, state: dict) -> None:
    for key, value in state.items():
        if "_extra_state" in key:
            continue
        name, e = key[:-1], int(key[-1])
        assert torch.equal(module.get_parameter(name)[e], value), key


@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_has_te_grouped_mlp_keys_and_layout(bias):
    module = experts(add_bias_linear=bias)
    state = module.state_dict()
    assert set(state) == set(te_layout(0, bias))
    for e in range(L):
        assert torch.equal(state[f"linear_fc1.weight{e}"], module.linear_fc1.weight[e])  # [2F, H], Megatron's [out, in]
        assert state[f"linear_fc1.weight{e}"].shape == (2 * F, H)
        assert state[f"linear_fc2.weight{e}"].shape == (H, F)
    assert state["linear_fc1._extra_state"] is None


@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_round_trips_bitwise_through_torch_save(bias):
    source, target = experts(0, add_bias_linear=bias), experts(1, add_bias_linear=bias)
    if bias:
        with torch.no_grad():
            source.linear_fc1.bias.normal_()
            source.linear_fc2.bias.normal_()
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer, weights_only=True))
    for (name, p), q in zip(source.named_parameters(), target.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("bias", [False, True])
def test_te_grouped_mlp_state_dict_loads(bias):
    module, state = experts(add_bias_linear=bias), te_layout(3, bias)
    module.load_state_dict(state)
    assert_holds(module, state)


def test_single_grouped_weight_loads():
    # TE's moe_single_grouped_weight writes one [L, out, in] tensor per linear.
    module, state = experts(), te_layout(3, bias=False)
    stacked = {f"linear_fc{i}.weight": torch.stack([state.pop(f"linear_fc{i}.weight{e}") for e in range(L)])
               for i in (1, 2)}
    module.load_state_dict({**state, **stacked})
    assert torch.equal(module.linear_fc1.weight, stacked["linear_fc1.weight"])
    assert torch.equal(module.linear_fc2.weight, stacked["linear_fc2.weight"])


def test_sequential_mlp_keys_load():
    # Megatron's SequentialMLP (prefix experts.): local_experts.<e>.linear_fc1.weight [2F, H] and per-expert
    # _extra_state (None in its local linears).
    module, grouped = experts(), te_layout(5, bias=False)
    sequential = {"linear_fc1._extra_state": None}  # not SequentialMLP's: must not be replaced by its extra state
    for e in range(L):
        for i in (1, 2):
            sequential[f"local_experts.{e}.linear_fc{i}.weight"] = grouped[f"linear_fc{i}.weight{e}"]
            sequential[f"local_experts.{e}.linear_fc{i}._extra_state"] = None
    module.load_state_dict(sequential)
    assert_holds(module, grouped)


def test_sequential_to_grouped_keys_renames_expert_keys_anywhere():
    w, b, extra = torch.zeros(2), torch.ones(2), object()
    state = {"decoder.layers.0.mlp.router.weight": w,
             "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.bias": b,
             "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1._extra_state": extra,
             "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1._extra_state": None,
             "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight": w}
    assert sequential_to_grouped_keys(state) == {
        "decoder.layers.0.mlp.router.weight": w,
        "decoder.layers.0.mlp.experts.linear_fc2.bias3": b,
        "decoder.layers.0.mlp.experts.linear_fc1._extra_state": extra,
        "decoder.layers.1.mlp.experts.linear_fc1.weight12": w}


def test_missing_expert_is_reported_under_its_key():
    module, state = experts(), te_layout(3, bias=False)
    before = module.linear_fc1.weight[2].clone()
    del state["linear_fc1.weight2"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"linear_fc1.weight2\""):
        module.load_state_dict(state)
    module = experts()
    result = module.load_state_dict(state, strict=False)
    assert result.missing_keys == ["linear_fc1.weight2"] and result.unexpected_keys == []
    assert torch.equal(module.linear_fc1.weight[2], before)  # kept
    assert torch.equal(module.linear_fc1.weight[3], state["linear_fc1.weight3"])  # the others load


def test_extra_expert_is_unexpected():
    state = te_layout(3, bias=False)
    state["linear_fc2.weight4"] = state["linear_fc2.weight0"]
    result = experts().load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["linear_fc2.weight4"]


def test_wrong_shape_names_the_key():
    state = te_layout(3, bias=False)
    state["linear_fc2.weight1"] = state["linear_fc2.weight1"].t()
    with pytest.raises(ValueError, match=r"linear_fc2.weight1: expected a tensor of shape \(16, 24\), got \(24, 16\)"):
        experts().load_state_dict(state)


def test_stacked_and_per_expert_weights_together_are_refused():
    state = te_layout(3, bias=False)
    state["linear_fc1.weight"] = torch.zeros(L, 2 * F, H, dtype=torch.float64)
    with pytest.raises(ValueError, match="linear_fc1.weight: expected either the stacked tensor or "
                                         "linear_fc1.weight0 .., got both"):
        experts().load_state_dict(state)


def test_distributed_checkpoint_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="decoder.layers.0.mlp.experts.linear_fc1.: .*--ckpt-format torch"):
        experts().sharded_state_dict(prefix="decoder.layers.0.mlp.experts.")
