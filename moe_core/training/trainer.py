"""The pretraining loop: data -> GPTModel -> token-mean loss -> AdamW, with evaluation, metrics and checkpoints.

Loss accounting (Megatron's calculate_per_token_loss): each micro-batch contributes
``sum(per-token loss) / tokens in the global batch``, so the accumulated gradient is the gradient of the
global batch's mean loss whatever the micro-batch and rank layout.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.training.checkpoint import load_checkpoint, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.data import build_token_streams, sample_batch, shard_rows
from moe_core.training.metrics import MetricsWriter
from moe_core.training.schedule import build_scheduler
from moe_core.training.tokenizer import build_tokenizer

# Dense bf16 tensor-core peaks (TFLOP/s) for MFU, by device-name substring.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
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
def evaluate(model: GPTModel, tokens, cfg: TrainingConfig, seq_length: int, device: torch.device, autocast) -> float:
    """Mean per-token loss over ``eval_iters`` fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(cfg.eval_iters):
        inputs, labels = sample_batch(tokens, cfg.micro_batch_size, seq_length, cfg.seed + _VALID_SEED_OFFSET, i)
        with autocast():
            total += model(inputs.to(device), labels.to(device)).mean().item()
    model.train(was_training)
    return total / cfg.eval_iters


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
    """Each aux / z loss of the last forward, summed over MoE layers (coefficients applied)."""
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


def pretrain(model_config: TransformerConfig, cfg: TrainingConfig, log=print) -> RunSummary:
    """Train a ``GPTModel`` on ``cfg``'s corpus and return the run's summary; see the module docstring."""
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"vocab_size: the tokenizer has {tokenizer.vocab_size} tokens, the model only {model_config.vocab_size}"
        )
    streams = build_token_streams(cfg.data_path, tokenizer)
    model = GPTModel(model_config).to(device)
    log(f"model: {model.num_parameters() / 1e6:.2f}M parameters, {model.num_parameters(active=True) / 1e6:.2f}M active; "
        f"corpus: {len(streams['train']):,} train / {len(streams['valid']):,} valid {tokenizer.unit}s")
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.lr, cfg.min_lr, cfg.lr_warmup_iters, cfg.train_iters)
    start_step = load_checkpoint(cfg.load, model, optimizer, scheduler) if cfg.load else 0

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16 and device.type == "cuda")

    num_micro = cfg.num_micro_batches(dp_size=1)
    global_batch = cfg.micro_batch_size * num_micro
    seq = model_config.seq_length
    tokens_per_step = global_batch * seq
    for layer in model.moe_layers():
        layer.router.aux_loss_scale = 1.0 / num_micro
    writer = MetricsWriter(cfg.output_dir)
    t_start = time.perf_counter()
    start_valid = evaluate(model, streams["valid"], cfg, seq, device, autocast)
    writer.log(start_step, {"valid_loss": start_valid})
    log(f"step {start_step}: validation loss {start_valid:.4f}")

    train_losses = []
    model.train()
    t_log, steps_since_log = time.perf_counter(), 0
    bar = tqdm(range(start_step, cfg.train_iters), desc="pretrain", unit="step", dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        inputs, labels = sample_batch(streams["train"], global_batch, seq, cfg.seed, step)
        loss_value = 0.0
        for micro_inputs, micro_labels in zip(inputs.split(cfg.micro_batch_size), labels.split(cfg.micro_batch_size)):
            with autocast():
                per_token = model(micro_inputs.to(device), micro_labels.to(device))
            loss = per_token.sum() / tokens_per_step
            loss.backward()
            loss_value += loss.item()
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in model.moe_layers():
            layer.router.update_expert_bias()
            layer.router.reset_global_aux_loss_tracker()
        train_losses.append(loss_value)
        steps_since_log += 1
        done = step + 1
        if done % cfg.log_interval == 0 or done == cfg.train_iters:
            elapsed = time.perf_counter() - t_log
            tokens_per_second = steps_since_log * tokens_per_step / elapsed
            metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                       "tokens_per_second": tokens_per_second, **router_losses(model), **expert_load_stats(model)}
            utilisation = mfu(model.flops_per_token(), tokens_per_second, device)
            if utilisation is not None:
                metrics["mfu"] = utilisation
            writer.log(done, metrics)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_second:,.0f}")
            t_log, steps_since_log = time.perf_counter(), 0
        if cfg.eval_interval and done % cfg.eval_interval == 0 and done != cfg.train_iters:
            writer.log(done, {"valid_loss": evaluate(model, streams["valid"], cfg, seq, device, autocast)})
        if cfg.save and cfg.save_interval and done % cfg.save_interval == 0:
            save_checkpoint(cfg.save, model, optimizer, scheduler, done)
    bar.close()
    end_valid = evaluate(model, streams["valid"], cfg, seq, device, autocast)
    writer.log(cfg.train_iters, {"valid_loss": end_valid})
    if cfg.save:
        save_checkpoint(cfg.save, model, optimizer, scheduler, cfg.train_iters)
    png = writer.close(f"{model_config.num_layers} layers, hidden {model_config.hidden_size}")
    seconds = time.perf_counter() - t_start
    log(f"validation loss: start {start_valid:.3f}, end {end_valid:.3f} (nats per {tokenizer.unit}); "
        f"{cfg.train_iters - start_step} steps in {seconds:.0f} s; metrics and {png.name} in {cfg.output_dir}")
    return RunSummary(start_valid, end_valid, train_losses, seconds)


__all__ = ["pretrain", "RunSummary", "build_optimizer", "evaluate", "expert_load_stats", "router_losses", "mfu"]
