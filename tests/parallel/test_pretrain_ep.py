"""The pretraining loop across ranks: EP = 2 under DDP and FSDP2 follows the single-process run step for step,
TP = 2 x EP = 2 follows EP = 2 (the same micro-batches), and checkpoints load in another layout (single
process, other wrapper) with identical parameters."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.models.full_state import gather_full_state_dict
from moe_core.models.gpt import GPTModel
from moe_core.moe.metrics import ep_load_imbalance
from moe_core.training.checkpoint import load_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.schedule import build_scheduler
from moe_core.training.step import build_optimizer, setup_training
from moe_core.training.trainer import pretrain
from tests.parallel._common import groups
from tests.parallel._launch import BACKEND, device, run_distributed

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _configs(ep: int, output_dir: str, fsdp2: bool, tp: int = 1, dp: int | None = None,
             dispatcher: str = "alltoall", moe_dispatch_sync_free: bool = False,
             **training) -> tuple[TransformerConfig, TrainingConfig]:
    model = TransformerConfig(moe_token_dispatcher_type=dispatcher, moe_dispatch_sync_free=moe_dispatch_sync_free,
        num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=256, seq_length=32,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
    )
    train = TrainingConfig(**{
        **dict(micro_batch_size=8 // (dp or ep), global_batch_size=8, train_iters=4, lr=3e-3, lr_warmup_iters=1,
               log_interval=1, eval_iters=2, output_dir=output_dir, use_torch_fsdp2=fsdp2, bf16=False,
               data_path=[str(STDLIB / "textwrap.py"), str(STDLIB / "shlex.py")]),
        **training,
    })
    return model, train


def _pretrain(ep: int, output_dir: str, fsdp2: bool, save: str | None = None, tp: int = 1, **options) -> dict:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    model_cfg, train_cfg = _configs(ep, output_dir, fsdp2, tp=tp, dp=dist.get_world_size() // tp, save=save,
                                    **options)
    torch._dynamo.reset()  # drops the compiled graphs and CUDA graph trees of this worker's earlier tasks
    counters.clear()
    summary = pretrain(model_cfg, train_cfg, log=lambda *_: None, pg_collection=groups(ep, 4, tp, tp))
    return {"start": summary.start_valid_loss, "end": summary.end_valid_loss, "train": summary.train_losses,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"], "cuda_graphs": _recorded_graphs()}


def _recorded_graphs() -> int:
    """The CUDA graphs recorded on this rank's device (0 off CUDA)."""
    if BACKEND != "nccl":
        return 0
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values())


@pytest.mark.parametrize("fsdp2", [False, True], ids=["ddp", "fsdp2"])
def test_pretrain_ep2_follows_single_process(tmp_path, fsdp2):
    model_cfg, train_cfg = _configs(1, str(tmp_path / "single"), False)
    single = pretrain(model_cfg, train_cfg, log=lambda *_: None)
    ranks = run_distributed(2, _pretrain, timeout=120, ep=2, output_dir=str(tmp_path / "ep2"), fsdp2=fsdp2)
    for r in ranks:  # every rank reports the same global numbers
        assert r == ranks[0]
    logged = [json.loads(line) for line in (tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines()]
    imbalance = [row["ep_load_imbalance"] for row in logged if "loss" in row]
    assert len(imbalance) == train_cfg.train_iters and all(1.0 <= x <= 2.0 for x in imbalance), imbalance
    got = ranks[0]
    torch.testing.assert_close(got["start"], single.start_valid_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got["train"]), torch.tensor(single.train_losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(got["end"], single.end_valid_loss, rtol=1e-4, atol=0)
    print(f"single {single.train_losses} / ep2 {got['train']}; valid end {single.end_valid_loss} / {got['end']}")


@pytest.mark.parametrize("dispatcher,sync_free,cuda_graph", [
    ("alltoall", False, False), ("allgather", False, False), ("alltoall", True, False), ("alltoall", True, True)])
def test_compiled_ep2_follows_single_process(tmp_path, dispatcher, sync_free, cuda_graph):
    """Each layer compiled under EP = 2: the exchange runs eagerly between compiled pieces (a traced exchange
    with host split sizes failed, or hung, on some torch releases), or, sync-free, traces into the layer's graph,
    which then replays as CUDA graphs with enable_cuda_graph (on NCCL, none skipped; on CPU the option compiles
    without them), here over two micro-batches a step (gradient accumulation under DDP) with evaluations
    between steps; training follows the eager single-process run."""
    # An evaluation batch is micro_batch_size x DP sequences: the single process's 4 x 1 are EP's 2 x 2.
    accumulate = dict(micro_batch_size=4, eval_interval=2) if cuda_graph else {}
    model_cfg, train_cfg = _configs(1, str(tmp_path / "single"), False, **accumulate)
    single = pretrain(model_cfg, train_cfg, log=lambda *_: None)
    graphs = dict(accumulate, enable_cuda_graph=True, micro_batch_size=2) if cuda_graph else {}
    ranks = run_distributed(2, _pretrain, timeout=240, ep=2, output_dir=str(tmp_path / "ep2"), fsdp2=False,
                            dispatcher=dispatcher, compile=True, moe_dispatch_sync_free=sync_free, **graphs)
    torch.testing.assert_close(torch.tensor(ranks[0]["train"]), torch.tensor(single.train_losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(ranks[0]["end"], single.end_valid_loss, rtol=1e-4, atol=0)
    if cuda_graph and BACKEND == "nccl":  # recorded, and none skipped
        assert [r["cudagraph_skips"] for r in ranks] == [0, 0]
        assert all(r["cuda_graphs"] > 0 for r in ranks), ranks


def test_compiled_fsdp2_ep2_bf16_follows_single_process(tmp_path):
    """FSDP2 x EP = 2, each block compiled, fused AdamW (foreach on CPU), bf16 on (FSDP2's MixedPrecisionPolicy on
    CUDA; ignored on CPU): the TRL report's FSDP + EP + compile optimizer crash does not happen, and training follows
    the single-process run (autocast there, so on CUDA within bf16 rounding)."""
    model_cfg, train_cfg = _configs(1, str(tmp_path / "single"), False, bf16=True)
    single = pretrain(model_cfg, train_cfg, log=lambda *_: None)
    ranks = run_distributed(2, _pretrain, timeout=240, ep=2, output_dir=str(tmp_path / "ep2"), fsdp2=True,
                            compile=True, bf16=True)
    rtol = 3e-2 if BACKEND == "nccl" else 1e-4
    torch.testing.assert_close(torch.tensor(ranks[0]["train"]), torch.tensor(single.train_losses), rtol=rtol, atol=0)
    torch.testing.assert_close(ranks[0]["end"], single.end_valid_loss, rtol=rtol, atol=0)


def _fsdp2_bf16_dtypes(output_dir: str) -> dict:
    """One forward and backward of the FSDP2 x EP = 2 model with bf16 on: the dtype the experts and the router
    receive, and the gradients' dtypes."""
    model_cfg, train_cfg = _configs(2, output_dir, True, bf16=True)
    state = setup_training(model_cfg, train_cfg, groups(2, 4))
    seen = {}

    def record(name: str):
        def hook(_module, args) -> None:
            seen.setdefault(name, args[0].dtype)
        return hook

    layer = state.model.moe_layers()[0]
    layer.experts.register_forward_pre_hook(record("experts"))
    layer.router.register_forward_pre_hook(record("router"))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(state.device)
    state.model(tokens, tokens).mean().backward()
    grads = {str(p.grad.dtype) for p in state.model.parameters() if p.grad is not None}
    return {"experts": str(seen["experts"]), "router": str(seen["router"]), "grads": sorted(grads),
            "autocast": str(state.autocast_dtype)}


def test_fsdp2_bf16_is_the_mixed_precision_policy():
    """Under FSDP2, bf16 is FSDP2's MixedPrecisionPolicy on CUDA (no autocast): the layers compute on bf16
    parameters and activations, the gradients land in float32 on the sharded parameters; on CPU bf16 is off."""
    ranks = run_distributed(2, _fsdp2_bf16_dtypes, timeout=120, output_dir="unused")
    compute = "torch.bfloat16" if BACKEND == "nccl" else "torch.float32"
    for r in ranks:
        assert r == {"experts": compute, "router": compute, "grads": ["torch.float32"], "autocast": "None"}, r


def _imbalance(counts: list[list[list[int]]]) -> float:
    """``ep_load_imbalance`` of MoE layers whose routers recorded ``counts[layer][rank]`` as this rank's loads."""
    import torch.distributed as dist

    loads_LE = torch.tensor([c[dist.get_rank()] for c in counts], device=device())
    return ep_load_imbalance(loads_LE, groups(2, 4))


def test_ep_load_imbalance_is_the_busiest_ranks_rows_over_the_mean():
    # Layer 1: the ranks' tokens route [3, 1, 0, 0] and [1, 1, 2, 0] rows to the 4 experts, [4, 2, 2, 0] in all:
    # EP rank 0 (experts 0-1) gets 6 rows, rank 1 gets 2, so 6 / 4 = 1.5. Layer 2 is balanced: 1.0.
    counts = [[[3, 1, 0, 0], [1, 1, 2, 0]], [[1, 1, 1, 1], [2, 0, 0, 2]]]
    assert run_distributed(2, _imbalance, timeout=60, counts=counts) == [1.25, 1.25]


def _setup_error(ep: int, tp: int = 1, **options) -> str:
    model_cfg, train_cfg = _configs(ep, "unused", False, tp=tp, dp=2 // tp, **options)
    with pytest.raises(ValueError, match="enable_cuda_graph") as err:
        setup_training(model_cfg, train_cfg, groups(ep, 4, tp, tp))
    return str(err.value)


def test_cuda_graphs_refuse_what_cannot_replay():
    """enable_cuda_graph is refused by name before the model is built where graphs could not replay: with the
    experts replicated over an expert-DP mesh of two ranks, or under dense TP (DDP is then FSDP2's replicate,
    which allocates parameters anew every step), and under EP with the default exchange (row counts that change
    every step)."""
    moving = run_distributed(2, _setup_error, timeout=60, ep=1, compile=True, enable_cuda_graph=True)
    assert moving[0] == moving[1] and "expert-DP 2" in moving[0]
    tensor_parallel = run_distributed(2, _setup_error, timeout=60, ep=1, tp=2, compile=True, enable_cuda_graph=True)
    assert "TP 2, expert-DP 1" in tensor_parallel[0]
    dynamic = run_distributed(2, _setup_error, timeout=60, ep=2, compile=True, enable_cuda_graph=True)
    assert "expert_model_parallel_size=2 and moe_dispatch_sync_free=False" in dynamic[0]


def test_pretrain_tp2_ep2_follows_ep2(tmp_path):
    """Four ranks, TP = 2 (ETP 2) x EP = 2 under FSDP2, against two ranks with EP = 2: the same two DP ranks'
    micro-batches, so the same losses (the trainer's evaluation, router-loss logging and schedule under TP)."""
    ep2 = run_distributed(2, _pretrain, timeout=120, ep=2, output_dir=str(tmp_path / "ep2"), fsdp2=False)[0]
    ranks = run_distributed(4, _pretrain, timeout=120, ep=2, tp=2, output_dir=str(tmp_path / "tp2"), fsdp2=True)
    for r in ranks:
        assert r == ranks[0]
    got = ranks[0]
    torch.testing.assert_close(got["start"], ep2["start"], rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got["train"]), torch.tensor(ep2["train"]), rtol=1e-4, atol=0)
    torch.testing.assert_close(got["end"], ep2["end"], rtol=1e-4, atol=0)


def _load(path: str, model_cfg: TransformerConfig, train_cfg: TrainingConfig) -> tuple[int, dict]:
    model = GPTModel(model_cfg)
    optimizer = build_optimizer(model, train_cfg)
    scheduler = build_scheduler(optimizer, train_cfg.lr, train_cfg.min_lr, train_cfg.lr_warmup_iters,
                                train_cfg.train_iters)
    step = load_checkpoint(path, model, optimizer, scheduler)
    return step, {**gather_full_state_dict(model, None),
                  **{f"exp_avg {n}": optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}}


def test_ep2_fsdp2_checkpoint_loads_in_one_process(tmp_path):
    """EP = 2 + FSDP2 saves (experts gathered over EP): one process loads the weights and Adam moments of
    the single-process run's own checkpoint."""
    run_distributed(2, _pretrain, timeout=120, ep=2, output_dir=str(tmp_path / "ep2"), fsdp2=True,
                    save=str(tmp_path / "ckpt_ep2"))
    model_cfg, train_cfg = _configs(1, str(tmp_path / "single"), False, save=str(tmp_path / "ckpt_single"))
    pretrain(model_cfg, train_cfg, log=lambda *_: None)
    step, got = _load(str(tmp_path / "ckpt_ep2"), model_cfg, train_cfg)
    _, want = _load(str(tmp_path / "ckpt_single"), model_cfg, train_cfg)
    assert step == train_cfg.train_iters
    for name, value in want.items():
        # On GPUs the runs use bf16 autocast and reduce in other orders: a looser absolute floor.
        atol = 1e-6 if BACKEND == "gloo" else 1e-5
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def _optimizer_meshes(ep: int, output_dir: str) -> dict:
    from torch.distributed.tensor import DTensor

    from moe_core.training.step import build_model

    model_cfg, train_cfg = _configs(ep, output_dir, fsdp2=True)
    model = build_model(model_cfg, train_cfg, torch.device("cpu"), groups(ep, 2))
    optimizer = build_optimizer(model, train_cfg)
    per_group = [{p.device_mesh.mesh_dim_names for p in g["params"] if isinstance(p, DTensor)}
                 for g in optimizer.param_groups]
    all_meshes = {p.device_mesh.mesh_dim_names for p in model.parameters() if isinstance(p, DTensor)}
    return {"per_group": per_group, "all": all_meshes}


def test_optimizer_groups_never_mix_meshes_under_fsdp2_ep(tmp_path):
    """The foreach/fused AdamW kernels batch a group's tensors: DTensors of the DP and expert-DP meshes must
    sit in separate groups (the TRL report's FSDP + EP optimizer crash)."""
    ranks = run_distributed(2, _optimizer_meshes, timeout=120, ep=2, output_dir=str(tmp_path))
    for r in ranks:
        assert len(r["all"]) == 2  # two meshes exist: a single group would mix them
        assert all(len(meshes) <= 1 for meshes in r["per_group"])  # empty groups allowed
