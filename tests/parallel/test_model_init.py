"""Model-scale start-up: ``build_model`` builds on the meta device, splits (TP, ETP, EP) and shards (FSDP2 or
replicate) there, then each rank allocates and initialises only its shards. The result is bitwise the
single-process model of the same seed, in every layout tested (gathered and compared on each rank)."""

from __future__ import annotations

import pytest
import torch

from moe_core.models.param_roles import param_roles
from moe_core.training.config import TrainingConfig
from moe_core.training.step import build_model
from tests.parallel._common import groups
from tests.parallel._launch import device, run_distributed
from tests.parallel.test_tensor_parallel import NUM_EXPERTS, _full, tp_config


def _build_and_compare(tp: int, ep: int, etp: int, fsdp2: bool, grouped: bool) -> list[str]:
    pg = groups(ep, NUM_EXPERTS, tp, etp)
    cfg = tp_config(tp, ep, etp, gate=True, moe_grouped_gemm=grouped)
    training = TrainingConfig(seed=7, use_torch_fsdp2=fsdp2, micro_batch_size=2)
    model = build_model(cfg, training, device(), pg)
    single = build_model(cfg.single_process(), training, device(), None)
    experts = {name for name, role in param_roles(model).items() if role.expert}
    differ = []
    for name, param in model.named_parameters():
        assert param.device.type == device().type, name
        if ".local_experts." in name:  # SequentialMLP: this rank's experts are global ones offset + l
            offset = pg.local_expert_indices(NUM_EXPERTS)[0]
            prefix, rest = name.split(".local_experts.")
            local, tail = rest.split(".", 1)
            expected = single.get_parameter(f"{prefix}.local_experts.{offset + int(local)}.{tail}")
            value = _full(param, False, pg)
        else:
            expected, value = single.get_parameter(name), _full(param, name in experts, pg)
        if not torch.equal(value, expected):
            differ.append(name)
    assert all(int(b.count_nonzero()) == 0 for b in model.buffers())
    return differ


@pytest.mark.parametrize("world,tp,ep,etp,fsdp2,grouped", [
    (2, 2, 1, 2, True, True),
    (2, 1, 2, 1, False, False),
    (4, 2, 2, 1, True, True),
])
def test_meta_build_equals_single_process_init(world, tp, ep, etp, fsdp2, grouped):
    for rank, differ in enumerate(run_distributed(world, _build_and_compare, timeout=120, tp=tp, ep=ep, etp=etp,
                                                  fsdp2=fsdp2, grouped=grouped)):
        assert not differ, f"rank {rank}: {differ}"
