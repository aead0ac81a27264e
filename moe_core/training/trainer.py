"""The pretraining loop: data -> GPTModel -> token-mean loss -> AdamW, with evaluation, metrics and checkpoints.

Loss accounting (Megatron's calculate_per_token_loss): each micro-batch contributes
``sum(per-token loss) / tokens in the global batch``, so the accumulated gradient is the gradient of the
global batch's mean loss whatever the micro-batch and rank layout.

Under torchrun (``WORLD_SIZE`` > 1) every rank is a data-parallel rank (``moe_core.parallel``): it trains on
its own rows of each global batch, experts are split over ``expert_model_parallel_size`` ranks, and the
model is wrapped with FSDP2 (``use_torch_fsdp2``) or DDP, both summing gradients (dense over DP, experts
over expert-DP). The model starts from the single-process initialisation (same seed, experts sliced), so a
run's losses are comparable across layouts; rank 0 logs.

Resuming (``load``): batches are a function of ``(seed, step)`` and the checkpoint restores the model,
AdamW, the LR schedule, the step and the RNG states, so N steps, save, load and N more give the losses of 2N
steps straight (``exit_interval`` stops the first half without shortening the schedule).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.parallel.ddp import apply_ddp
from moe_core.parallel.fsdp import apply_fsdp2, split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_
from moe_core.parallel.loss import reduce_loss_for_logging
from moe_core.parallel.state import load_full_state_dict
from moe_core.training.checkpoint import load_checkpoint, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.data import build_token_streams, sample_batch, shard_rows
from moe_core.training.metrics import MetricsWriter
from moe_core.training.schedule import build_scheduler
from moe_core.training.tokenizer import build_tokenizer

# Dense bf16 tensor-core peaks (TFLOP/s, vendor datasheets) for MFU, by device-name substring, first match
# wins: the PCIe H100 before the SXM one.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}
_VALID_SEED_OFFSET = 1_000_003


@dataclass
class RunSummary:
    """What a run reports: validation losses (nats per token) at its start and end, and its wall time."""

    start_valid_loss: float
    end_valid_loss: float
    train_losses: list[float]
    seconds: float


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and expert weights only (not on norms, biases or 1-D params)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


@torch.no_grad()
def evaluate(model: GPTModel, tokens, cfg: TrainingConfig, seq_length: int, device: torch.device, autocast,
             pg_collection=None) -> float:
    """Mean per-token loss over ``eval_iters`` fixed validation batches of ``micro_batch_size * dp`` sequences.

    Each DP rank scores its rows of every batch; the sums meet in one all-reduce, so the value is the same
    as one process scoring whole batches.
    """
    dp_size, dp_rank = _dp(pg_collection)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(cfg.eval_iters):
        inputs, labels = sample_batch(tokens, cfg.micro_batch_size * dp_size, seq_length,
                                      cfg.seed + _VALID_SEED_OFFSET, i)
        inputs, labels = shard_rows(inputs, dp_rank, dp_size), shard_rows(labels, dp_rank, dp_size)
        with autocast():
            total += model(inputs.to(device), labels.to(device)).double().sum()
    model.train(was_training)
    total = reduce_loss_for_logging(total, None if pg_collection is None else pg_collection.dp)
    return total.item() / (cfg.eval_iters * cfg.micro_batch_size * dp_size * seq_length)


def _dp(pg_collection) -> tuple[int, int]:
    return (1, 0) if pg_collection is None else (pg_collection.dp_size, pg_collection.dp_rank)


def build_model(model_config: TransformerConfig, cfg: TrainingConfig, device: torch.device, pg_collection=None
                ) -> GPTModel:
    """The GPTModel of the single-process run with seed ``cfg.seed``; under EP this rank's experts of it,
    wrapped with FSDP2 or DDP."""
    torch.manual_seed(cfg.seed)
    if pg_collection is None:
        return GPTModel(model_config).to(device)
    full = GPTModel(dataclasses.replace(model_config, expert_model_parallel_size=1))
    model = GPTModel(model_config, pg_collection)
    load_full_state_dict(model, full.state_dict(), pg_collection)
    del full
    model.to(device)
    return (apply_fsdp2 if cfg.use_torch_fsdp2 else apply_ddp)(model, pg_collection)


def expert_load_stats(model: GPTModel) -> dict[str, float]:
    """Min and max rows per expert over all MoE layers' last forward, and the mean coefficient of variation."""
    loads = [layer.router.tokens_per_expert.float() for layer in model.moe_layers()]
    if not loads:
        return {}
    load_LE = torch.stack(loads)
    cv = (load_LE.std(dim=1, unbiased=False) / load_LE.mean(dim=1).clamp_min(1e-9)).mean()
    return {"expert_load_min": load_LE.min().item(), "expert_load_max": load_LE.max().item(),
            "expert_load_cv": cv.item()}


def router_losses(model: GPTModel) -> dict[str, float]:
    """Each aux / z loss of the last forward, summed over MoE layers (raw values without their coefficients;
    a balanced router's aux_loss is 1.0 per layer)."""
    totals: dict[str, float] = {}
    for layer in model.moe_layers():
        for key, value in layer.router.aux_losses.items():
            totals[key] = totals.get(key, 0.0) + value.item()
    return totals


def mfu(flops_per_token: float, tokens_per_second: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation on CUDA: achieved FLOP/s over the device's dense bf16 peak; None elsewhere."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return None if peak is None else flops_per_token * tokens_per_second / (peak * 1e12)


def pretrain(model_config: TransformerConfig, cfg: TrainingConfig, log=print, pg_collection=None) -> RunSummary:
    """Train a ``GPTModel`` on ``cfg``'s corpus and return the run's summary; see the module docstring.

    ``pg_collection``: the ranks' groups (``moe_core.parallel.launch.init_distributed``), None for one process.
    """
    pg = pg_collection
    is_logger = pg is None or dist.get_rank() == 0
    if not is_logger:
        log = _silent
    if (1 if pg is None else pg.ep_size) != model_config.expert_model_parallel_size:
        raise ValueError(
            f"pg_collection: EP size {1 if pg is None else pg.ep_size} differs from the config's "
            f"expert_model_parallel_size ({model_config.expert_model_parallel_size})"
        )
    dp_size, dp_rank = _dp(pg)
    if pg is not None and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"vocab_size: the tokenizer has {tokenizer.vocab_size} tokens, the model only {model_config.vocab_size}"
        )
    streams = build_token_streams(cfg.data_path, tokenizer)
    model = build_model(model_config, cfg, device, pg)
    dense_params, expert_params = split_expert_params(model)
    if pg is not None:
        log(f"parallel: {dist.get_world_size()} ranks ({dist.get_backend()}), EP {pg.ep_size}, expert-DP "
            f"{pg.expt_dp_size}, {'FSDP2' if cfg.use_torch_fsdp2 else 'DDP'}")
    # Parameter and FLOP counts of the whole model (every EP rank's experts), from a weightless copy.
    with torch.device("meta"):
        whole = GPTModel(dataclasses.replace(model_config, expert_model_parallel_size=1))
    log(f"model: {whole.num_parameters() / 1e6:.2f}M parameters, "
        f"{whole.num_parameters(active=True) / 1e6:.2f}M active; "
        f"corpus: {len(streams['train']):,} train / {len(streams['valid']):,} valid {tokenizer.unit}s")
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.lr, cfg.min_lr, cfg.lr_warmup_iters, cfg.train_iters)
    start_step = load_checkpoint(cfg.load, model, optimizer, scheduler, pg, seed=cfg.seed) if cfg.load else 0
    if start_step > cfg.train_iters:
        raise ValueError(f"train_iters ({cfg.train_iters}) is below the step of the checkpoint in {cfg.load} "
                         f"({start_step})")
    end_step = cfg.train_iters
    if cfg.exit_interval:
        end_step = min(end_step, (start_step // cfg.exit_interval + 1) * cfg.exit_interval)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16 and device.type == "cuda")

    num_micro = cfg.num_micro_batches(dp_size=dp_size)
    global_batch = cfg.micro_batch_size * num_micro * dp_size
    seq = model_config.seq_length
    tokens_per_step = global_batch * seq
    for layer in model.moe_layers():
        # Gradients are summed over micro-batches and DP ranks: the aux loss averages over all of them.
        layer.router.aux_loss_scale = 1.0 / (num_micro * dp_size)
    writer = (MetricsWriter(cfg.output_dir, cfg.tensorboard_dir, resume_step=start_step if cfg.load else None)
              if is_logger else _NoWriter())
    t_start = time.perf_counter()
    start_valid = evaluate(model, streams["valid"], cfg, seq, device, autocast, pg)
    writer.log(start_step, {"valid_loss": start_valid})
    log(f"step {start_step}: validation loss {start_valid:.4f}")

    train_losses = []
    model.train()
    t_log, steps_since_log = time.perf_counter(), 0
    bar = tqdm(range(start_step, end_step), desc="pretrain", unit="step", dynamic_ncols=True, mininterval=2.0,
               disable=not is_logger)
    for step in bar:
        inputs, labels = sample_batch(streams["train"], global_batch, seq, cfg.seed, step)
        inputs, labels = shard_rows(inputs, dp_rank, dp_size), shard_rows(labels, dp_rank, dp_size)
        step_loss = torch.zeros((), device=device)
        for micro_inputs, micro_labels in zip(inputs.split(cfg.micro_batch_size), labels.split(cfg.micro_batch_size)):
            with autocast():
                per_token = model(micro_inputs.to(device), micro_labels.to(device))
            loss = per_token.sum() / tokens_per_step  # tokens_per_step counts every rank's tokens
            loss.backward()
            step_loss += loss.detach()
        loss_value = reduce_loss_for_logging(step_loss, None if pg is None else pg.dp).item()
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else math.inf
        # One global norm over dense (DP mesh) and expert (expert-DP mesh) gradients, one all-reduce.
        grad_norm = clip_grad_norm_(dense_params, expert_params, max_norm, pg).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in model.moe_layers():
            if pg is not None:
                # Expert-bias updates must see the global batch's loads so the bias stays equal on all ranks.
                dist.all_reduce(layer.router.local_tokens_per_expert, group=pg.dp)
            layer.router.update_expert_bias()
            layer.router.reset_global_aux_loss_tracker()
        train_losses.append(loss_value)
        steps_since_log += 1
        done = step + 1
        if done % cfg.log_interval == 0 or done == end_step:
            elapsed = time.perf_counter() - t_log
            tokens_per_second = steps_since_log * tokens_per_step / elapsed
            # "lr": the rate the next step will use (what Megatron logs), min_lr after the last step.
            metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                       "tokens_per_second": tokens_per_second, **router_losses(model), **expert_load_stats(model)}
            utilisation = mfu(whole.flops_per_token(), tokens_per_second / dp_size, device)
            if utilisation is not None:
                metrics["mfu"] = utilisation
            writer.log(done, metrics)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_second:,.0f}")
            t_log, steps_since_log = time.perf_counter(), 0
        t_pause = time.perf_counter()
        if cfg.eval_interval and done % cfg.eval_interval == 0 and done != end_step:
            writer.log(done, {"valid_loss": evaluate(model, streams["valid"], cfg, seq, device, autocast, pg)})
        if cfg.save and cfg.save_interval and done % cfg.save_interval == 0 and done != end_step:
            save_checkpoint(cfg.save, model, optimizer, scheduler, done, pg, seed=cfg.seed)
        t_log += time.perf_counter() - t_pause  # tokens/s counts training time only
    bar.close()
    end_valid = evaluate(model, streams["valid"], cfg, seq, device, autocast, pg)
    writer.log(end_step, {"valid_loss": end_valid})
    if cfg.save:
        save_checkpoint(cfg.save, model, optimizer, scheduler, end_step, pg, seed=cfg.seed)
    png = writer.close(f"{model_config.num_layers} layers, hidden {model_config.hidden_size}")
    seconds = time.perf_counter() - t_start
    log(f"validation loss: start {start_valid:.3f}, end {end_valid:.3f} nats per {tokenizer.unit}")
    log(f"steps {start_step}..{end_step} of {cfg.train_iters} in {seconds:.0f} s; metrics and {png and png.name} "
        f"in {cfg.output_dir}")
    return RunSummary(start_valid, end_valid, train_losses, seconds)


def _silent(*_args, **_kwargs) -> None:
    """``log`` of the ranks other than 0."""


class _NoWriter:
    """``MetricsWriter`` of the ranks other than 0: writes nothing."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self, title: str) -> None:
        return None


__all__ = ["pretrain", "RunSummary", "build_model", "build_optimizer", "evaluate", "expert_load_stats",
           "router_losses", "mfu"]
