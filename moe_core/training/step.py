"""One training step and what it needs: the model, AdamW, the LR schedule and the step's batch arithmetic.

Loss accounting (Megatron's calculate_per_token_loss): each micro-batch contributes
``sum(per-token loss) / tokens in the global batch`` (with masked labels, the tokens that count), so the
accumulated gradient is the gradient of the global batch's mean loss whatever the micro-batch and rank layout.

Non-finite steps (Megatron's skipped iterations): when the global loss or the global gradient norm is NaN or
infinite, the step leaves the weights, AdamW's moments, the LR schedule and the expert biases as they were and
only drops the gradients. Both values are reduced over all ranks before the test, so every rank takes the same
branch and issues the same collectives.

Under torchrun (``moe_core.parallel``) the ranks form TP groups of ``tensor_model_parallel_size`` (attention,
MLPs and the sequence split over them, ``tensor_parallel``), the TP groups are the data-parallel ranks, and
experts are split over ``expert_model_parallel_size`` ranks (and their fc1 / fc2 over ETP). The model is
wrapped with FSDP2 (``use_torch_fsdp2``) or DDP, both summing gradients (dense over DP, experts over
expert-DP). The model is built on the meta device and each rank initialises only its shards, with the
values of the single-process initialisation (same seed), so a run's losses are comparable across layouts.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.models.init import init_weights
from moe_core.models.param_roles import expert_modules, expert_offset, model_parts
from moe_core.models.tp_plan import apply_tensor_parallel
from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.ddp import apply_ddp, ddp_keeps_parameters_in_place
from moe_core.parallel.fsdp import apply_fsdp2, split_expert_params
from moe_core.parallel.grad_clip import clip_coefficient, get_grad_norm, scale_grads_
from moe_core.parallel.loss import global_token_count, reduce_loss_for_logging
from moe_core.parallel.process_groups import ProcessGroupCollection
from moe_core.training.batch import Batch
from moe_core.training.config import TrainingConfig
from moe_core.training.memory import check_model_fits
from moe_core.training.schedule import build_scheduler


@dataclass
class TrainingState:
    """Everything ``train_step`` touches; built by ``setup_training``.

    Attributes:
        model: the (wrapped) ``GPTModel``; optimizer / scheduler: AdamW and its LR schedule.
        dense_params / expert_params: the model's parameters by the mesh their gradients reduce over.
        device: where the model lives. pg_collection: the ranks' groups, None for one process.
        micro_batch_size: sequences per forward. num_micro_batches: forwards per step on this rank.
        tokens_per_step: tokens of the global batch (every rank's), the loss's denominator.
        max_norm: gradient clipping threshold (inf: no clipping).
        autocast_dtype: the dtype of ``torch.autocast`` around forward passes, or None for none.
        defer_gradient_sync: DDP (``parallel.apply_ddp``): gradients are reduced once, in the last micro-batch's
            backward, not in every one.
        cuda_graph: the compiled layers replay CUDA graphs (``TrainingConfig.enable_cuda_graph``); each step and
            each evaluation forward starts with ``mark_step_begin``.
        count_loss_tokens: labels may be masked (``eod_mask_loss``, ``sft``): the loss's denominator is the global
            batch's count of labels that count (one all-reduce per step) instead of ``tokens_per_step``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dense_params: list[torch.nn.Parameter]
    expert_params: list[torch.nn.Parameter]
    device: torch.device
    pg_collection: ProcessGroupCollection | None
    micro_batch_size: int
    num_micro_batches: int
    tokens_per_step: int
    max_norm: float
    autocast_dtype: torch.dtype | None
    defer_gradient_sync: bool = False
    cuda_graph: bool = False
    count_loss_tokens: bool = False

    def mark_step_begin(self) -> None:
        """Call before a training step and before each evaluation forward: under CUDA graphs, the graphs then
        replay over the memory of the outputs before (``torch.compiler.cudagraph_mark_step_begin``). The trainer
        is done with those by then; what a module keeps lives in its buffers (the routers' records)."""
        if self.cuda_graph:
            torch.compiler.cudagraph_mark_step_begin()

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` to ``autocast_dtype`` on this device, or a no-op context."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @property
    def dp_size(self) -> int:
        return 1 if self.pg_collection is None else self.pg_collection.dp_size

    @property
    def dp_rank(self) -> int:
        return 0 if self.pg_collection is None else self.pg_collection.dp_rank


def build_model(model_config: TransformerConfig, cfg: TrainingConfig, device: torch.device,
                pg_collection: ProcessGroupCollection | None = None) -> GPTModel:
    """The GPTModel of the single-process run with seed ``cfg.seed`` (``models.init.init_weights``); under
    EP / TP this rank's experts and TP shards of it, wrapped with FSDP2 or DDP.

    Built on the meta device, split (and sharded with FSDP2) there, then allocated on ``device`` and initialised:
    a rank never holds more than its shards (and one whole parameter while initialising it), so the model may be
    far larger than one device. DDP wraps the allocated model: its parameters are whole on every rank anyway,
    and the experts it leaves unwrapped keep their ``allreduce`` mark (allocation would replace them). With
    ``bf16`` on CUDA, FSDP2 gets a ``MixedPrecisionPolicy`` (bf16 parameters for compute and all-gather, float32
    gradient reduction) instead of autocast."""
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        model = GPTModel(model_config, pg_collection)
    if pg_collection is not None:
        apply_tensor_parallel(model, pg_collection)
        if cfg.use_torch_fsdp2:
            mp_policy = None
            if _bf16_on(cfg, device):
                mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            apply_fsdp2(model, pg_collection, model_parts(model), mp_policy=mp_policy)
    model.to_empty(device=device)
    init_weights(model, cfg.seed, expert_offset(model_config, pg_collection))
    if _wraps_with_ddp(cfg, pg_collection):
        apply_ddp(model, pg_collection, model_parts(model))
    return model


def _wraps_with_ddp(cfg: TrainingConfig, pg_collection: ProcessGroupCollection | None) -> bool:
    return pg_collection is not None and not cfg.use_torch_fsdp2


def _bf16_on(cfg: TrainingConfig, device: torch.device) -> bool:
    return cfg.bf16 and device.type == "cuda"


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig, *, fused: bool | None = None,
                    foreach: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and expert weights only (not on norms, biases or 1-D params).

    Fused (the role of apex's and TE's FusedAdam in Megatron) when the parameters live on CUDA, torch's default
    elsewhere, unless ``fused`` / ``foreach`` pick the implementation (torch.optim.AdamW's arguments). Four
    parameter groups, in every process layout (so checkpoints load across layouts), some possibly empty: dense
    and expert parameters, each with and without decay. A group never mixes meshes: the fused and foreach
    kernels batch a group's tensors, and DTensors of different meshes cannot share a batch. Dense parameters
    live on the DP (x TP) mesh, experts on the expert-DP (x ETP) mesh: ``tensor_parallel`` makes every dense
    parameter a DTensor of the TP mesh, so FSDP2 / replicate put them all on one mesh.

    Raises:
        ValueError: a group would hold DTensors of different meshes (naming two of them).
    """
    dense, experts = split_expert_params(model, expert_modules(model))
    names = {id(p): name for name, p in model.named_parameters()}
    param_groups = [{"params": [p for p in params if (p.dim() >= 2) == decay],
                     "weight_decay": cfg.weight_decay if decay else 0.0}
                    for params in (dense, experts) for decay in (True, False)]
    for group in param_groups:
        _check_one_mesh(group["params"], names)
    if fused is None and foreach is None:
        fused = all(p.device.type == "cuda" for p in model.parameters()) or None
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=fused, foreach=foreach)


def _check_one_mesh(params: list[torch.nn.Parameter], names: dict[int, str]) -> None:
    meshes = {}
    for p in params:
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        meshes.setdefault(mesh, names[id(p)])
    if len(meshes) > 1:
        (a, name_a), (b, name_b) = list(meshes.items())[:2]
        describe = [m.mesh_dim_names if m is not None else "no mesh (a plain tensor)" for m in (a, b)]
        raise ValueError(f"model: optimizer group mixes meshes: {name_a} on {describe[0]}, {name_b} on {describe[1]}; "
                         "apply tensor_parallel before FSDP2 / replicate so every dense parameter shares one mesh")


def training_device(pg_collection: ProcessGroupCollection | None) -> torch.device:
    """This rank's GPU under NCCL, else CUDA when available, else the CPU."""
    if pg_collection is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def setup_training(model_config: TransformerConfig, cfg: TrainingConfig,
                   pg_collection: ProcessGroupCollection | None = None) -> TrainingState:
    """Build the model (``build_model``), AdamW and the LR schedule, and set each router's aux-loss scale.

    Raises:
        ValueError: the process groups' EP size differs from ``model_config.expert_model_parallel_size``
            (``GPTModel`` checks it); ``cfg.enable_cuda_graph`` where graphs could not replay (``_check_cuda_graph``);
            the model cannot fit in the device's memory (``memory.check_model_fits``, before anything is allocated).
    """
    if cfg.enable_cuda_graph:
        _check_cuda_graph(model_config, pg_collection)
    device = training_device(pg_collection)
    check_model_fits(model_config, device, pg_collection)
    model = build_model(model_config, cfg, device, pg_collection)
    ddp = _wraps_with_ddp(cfg, pg_collection)
    if cfg.compile:
        # Per layer, as torchtitan does. fullgraph proves the single-process layer traces without a break;
        # under DDP/FSDP2 their hooks run inside the compiled call and may break the graph.
        mode = "reduce-overhead" if cfg.enable_cuda_graph else None
        for layer in model.decoder.layers:
            layer.compile(fullgraph=pg_collection is None, mode=mode)
        if ddp:
            # torch's DDP fills its buckets layer by layer already; Dynamo's DDPOptimizer would split every
            # layer's graph at bucket boundaries, host time per piece (a global option: torchtitan's apply_ddp
            # sets it too).
            torch._dynamo.config.optimize_ddp = False
    dense_params, expert_params = split_expert_params(model, expert_modules(model))
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.lr, cfg.min_lr, cfg.lr_warmup_iters, cfg.train_iters)
    dp_size = 1 if pg_collection is None else pg_collection.dp_size
    num_micro = cfg.num_micro_batches(dp_size=dp_size)
    # FSDP2 casts the parameters itself (build_model); DDP and one process use autocast.
    fsdp2_casts = pg_collection is not None and cfg.use_torch_fsdp2
    for layer in model.moe_layers():
        # Gradients are summed over micro-batches and DP ranks: the aux loss averages over all of them.
        layer.router.aux_loss_scale = 1.0 / (num_micro * dp_size)
    return TrainingState(
        model=model, optimizer=optimizer, scheduler=scheduler, dense_params=dense_params,
        expert_params=expert_params, device=device, pg_collection=pg_collection,
        micro_batch_size=cfg.micro_batch_size, num_micro_batches=num_micro,
        tokens_per_step=cfg.micro_batch_size * num_micro * dp_size * model_config.seq_length,
        max_norm=cfg.clip_grad if cfg.clip_grad > 0 else math.inf,
        autocast_dtype=torch.bfloat16 if _bf16_on(cfg, device) and not fsdp2_casts else None,
        defer_gradient_sync=ddp, cuda_graph=cfg.enable_cuda_graph, count_loss_tokens=cfg.eod_mask_loss or cfg.sft,
    )


def _check_cuda_graph(model_config: TransformerConfig, pg_collection: ProcessGroupCollection | None) -> None:
    """A graph replays only over the same addresses and shapes: parameters that stay put (DDP keeps them only
    without TP and with one rank per expert-DP mesh) and, under EP, the sync-free exchange (the default one's
    row counts change every step, and each new count would record another graph)."""
    if pg_collection is not None and not ddp_keeps_parameters_in_place(pg_collection):
        raise ValueError("enable_cuda_graph: needs parameters at fixed addresses, which DDP keeps only without tensor "
                         f"parallelism and with one rank per expert-DP mesh; got TP {pg_collection.tp_size}, "
                         f"expert-DP {pg_collection.expt_dp_mesh.size()}")
    if model_config.expert_model_parallel_size > 1 and not model_config.moe_dispatch_sync_free:
        raise ValueError("enable_cuda_graph: under EP needs moe_dispatch_sync_free (static shapes), got "
                         f"expert_model_parallel_size={model_config.expert_model_parallel_size} and "
                         "moe_dispatch_sync_free=False")


def train_step(state: TrainingState, inputs: torch.Tensor, labels: torch.Tensor,
               position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Forward and backward over this rank's micro-batches, clip, then (unless skipped) AdamW step, LR step
    and expert-bias update.

    Args:
        inputs / labels: ``[num_micro_batches * micro_batch_size, S]`` int64, this rank's rows of the
            global batch (on any device); labels ``-100`` where the loss is masked.
        position_ids / document_ids: None, or the same rows' positions and documents (``GPTModel.forward``).
    Returns:
        ``(loss, grad_norm, skipped)``: the global batch's mean loss and the global gradient norm before
        clipping (0-dim tensors on ``state.device``, equal on all ranks), and whether the step was skipped for
        a non-finite loss or norm (module docstring); deciding it is the step's one host sync.
    Raises:
        CollectiveError: a collective of the step did not complete (a stuck, stopped or dead rank).
    """
    model, pg = state.model, state.pg_collection
    state.mark_step_begin()
    step_loss = torch.zeros((), device=state.device)
    batch = Batch(inputs, labels, position_ids, document_ids)
    num_tokens = state.tokens_per_step  # every rank's tokens
    if state.count_loss_tokens:
        num_tokens = global_token_count(batch.num_loss_tokens, None if pg is None else pg.dp, state.device).clamp_min(1)
    micro_batches = batch.split(state.micro_batch_size)
    for i, micro_batch in enumerate(micro_batches):
        if state.defer_gradient_sync:
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        # Names the collectives the wrappers issue inside (FSDP2 all-gathers, gradient reductions); the MoE
        # all-to-alls name themselves.
        with named_collective(f"in micro-batch {i}'s forward or backward (FSDP2/DDP parameter all-gather or "
                              "gradient reduction)"):
            with state.autocast():
                per_token = model(*micro_batch.to(state.device))
            loss = per_token.sum() / num_tokens
            loss.backward()
        step_loss += loss.detach()
    step_loss = reduce_loss_for_logging(step_loss, None if pg is None else pg.dp)
    grad_norm, skipped = _clip_and_step(state, step_loss)
    if not skipped:
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    for layer in model.moe_layers():
        layer.router.finish_step(skipped)
    return step_loss, grad_norm, skipped


def _clip_and_step(state: TrainingState, step_loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Clip to ``max_norm`` and step AdamW unless the loss or the global gradient norm is non-finite;
    ``(grad_norm, skipped)``.

    One host read gets both verdicts, as Megatron's ``clip_grad_by_total_norm_fp32`` reads the norm: a
    non-finite step skips the optimizer, and gradients already within ``max_norm`` reach AdamW untouched.
    Gradients to clip are divided by ``1 / coef`` inside a fused AdamW's kernel when its parameters are plain
    tensors (the ``grad_scale`` protocol of ``torch.amp.GradScaler``; the kernel then also writes each
    unscaled gradient back, so only clipping steps pay that pass), else scaled in place before the step.
    """
    pg, optimizer = state.pg_collection, state.optimizer
    # One global norm over dense (DP mesh) and expert (expert-DP mesh) gradients, one all-reduce.
    grad_norm = get_grad_norm(state.dense_params, state.expert_params, pg)
    coef = clip_coefficient(grad_norm, state.max_norm)
    all_finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm)
    finite, clip = torch.stack([all_finite.float(), (coef < 1).float()]).tolist()  # the step's one host read
    if not finite:
        return grad_norm, True
    if clip and _fused_plain(optimizer):
        optimizer.grad_scale = coef.reciprocal()
    elif clip:
        scale_grads_(state.dense_params + state.expert_params, coef)
    try:
        optimizer.step()
    finally:
        vars(optimizer).pop("grad_scale", None)
    return grad_norm, False


def _fused_plain(optimizer: torch.optim.Optimizer) -> bool:
    """A fused optimizer whose parameters are all plain tensors (no DTensors)."""
    return bool(optimizer.defaults.get("fused")) and not any(
        isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


__all__ = ["TrainingState", "build_model", "build_optimizer", "setup_training", "train_step", "training_device"]
