"""The pretraining loop: data -> GPTModel -> token-mean loss -> AdamW, with evaluation, metrics and checkpoints.

The step itself (loss accounting, parallel wrapping, AdamW) is ``moe_core.training.step``; this module
adds the data, evaluation, logging and checkpoints around it. Rank 0 logs.

Resuming (``load``): batches are a function of ``(seed, step)`` and the checkpoint restores the model,
AdamW, the LR schedule, the step and the RNG states, so N steps, save, load and N more give the losses of 2N
steps straight (``exit_interval`` stops the first half without shortening the schedule).

Non-finite steps: ``train_step`` skips a step whose loss or gradient norm is NaN or Inf; the loop logs each
one with the count so far and stops with ``TrainingDivergedError`` once more than ``max_skipped_steps`` were
skipped. Weights are never stepped with non-finite gradients and a checkpoint never holds non-finite values.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from moe_core.config import TransformerConfig
from moe_core.models.flops import megatron_flops_per_token
from moe_core.models.gpt import GPTModel
from moe_core.moe.metrics import routing_report
from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.launch import check_ranks_agree
from moe_core.parallel.loss import reduce_loss_for_logging
from moe_core.parallel.process_groups import ProcessGroupCollection
from moe_core.training.checkpoint import check_save_dir, load_checkpoint, load_model_weights, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.datasets import build_datasets
from moe_core.training.fast_path import resolve_fast_path
from moe_core.training.loader import Prefetcher
from moe_core.training.metrics import MetricsWriter
from moe_core.training.step import TrainingState, setup_training, train_step, training_device
from moe_core.training.tokenizer import build_tokenizer

# Dense bf16 tensor-core peaks (TFLOP/s, vendor datasheets) for MFU, by device-name substring, first match
# wins: the PCIe H100 before the SXM one.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}
_VALID_SEED_OFFSET = 1_000_003


class TrainingDivergedError(RuntimeError):
    """More than ``max_skipped_steps`` steps had a non-finite loss or gradient norm."""


@dataclass
class RunSummary:
    """What a run reports: validation losses (nats per token) at its start and end, and its wall time."""

    start_valid_loss: float
    end_valid_loss: float
    train_losses: list[float]
    seconds: float


@torch.no_grad()
def evaluate(state: TrainingState, source, cfg: TrainingConfig) -> float:
    """Mean per-token loss over ``eval_iters`` fixed validation batches of ``micro_batch_size * dp`` sequences
    (``source``: a split of ``datasets.build_datasets``), over the tokens whose labels count.

    Each DP rank scores its rows of every batch; the sums meet in one all-reduce, so the value is the same
    as one process scoring whole batches.
    """
    model, dp_size, dp_rank = state.model, state.dp_size, state.dp_rank
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=state.device)  # loss, tokens
    for i in range(cfg.eval_iters):
        batch = source.batch(cfg.micro_batch_size * dp_size, cfg.seed + _VALID_SEED_OFFSET, i, dp_rank, dp_size)
        state.mark_step_begin()
        with state.autocast():
            sums[0] += model(*batch.to(state.device)).double().sum()
        sums[1] += batch.num_loss_tokens.item()
    model.train(was_training)
    group = None if state.pg_collection is None else state.pg_collection.dp
    total, count = reduce_loss_for_logging(sums, group).tolist()
    return total / max(count, 1)


def peak_memory_gib(device: torch.device, pg_collection: ProcessGroupCollection | None) -> float:
    """The most CUDA memory any rank has allocated since start-up (``torch.cuda.max_memory_allocated``), GiB;
    collective over all ranks (one all-reduce)."""
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    if pg_collection is not None:
        with named_collective("all_reduce (peak memory)"):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def mfu(flops_per_token: float, tokens_per_second: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation on CUDA: achieved FLOP/s over the device's dense bf16 peak; None elsewhere."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return None if peak is None else flops_per_token * tokens_per_second / (peak * 1e12)


@dataclass
class _Run:
    """What the steps of ``pretrain`` share."""

    model_config: TransformerConfig
    cfg: TrainingConfig
    pg: ProcessGroupCollection | None
    log: Callable[..., None]
    state: TrainingState
    data: dict
    unit: str  # the tokenizer's unit: "token" or "byte"
    whole: GPTModel  # the whole model (every EP rank's experts) on the meta device, for FLOP counts
    start_step: int
    end_step: int
    writer: MetricsWriter | _NoWriter
    is_logger: bool


@dataclass
class _LogWindow:
    """The training time, steps and data wait since the last log row; ``paused()`` leaves time out."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_wait: float = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t_pause = time.perf_counter()
        yield
        self.start += time.perf_counter() - t_pause  # tokens/s counts training time only


def pretrain(model_config: TransformerConfig, cfg: TrainingConfig, log=print,
             pg_collection: ProcessGroupCollection | None = None) -> RunSummary:
    """Train a ``GPTModel`` on ``cfg``'s corpus and return the run's summary; see the module docstring.

    ``pg_collection``: the ranks' groups (``moe_core.parallel.launch.init_distributed``), None for one process;
    every rank must pass equal configs (``check_ranks_agree`` raises naming the fields that differ).
    """
    run = _set_up(model_config, cfg, log, pg_collection)
    t_start = time.perf_counter()
    start_valid = _validate(run, run.start_step)
    run.log(f"step {run.start_step}: validation loss {start_valid:.4f}")
    train_losses = _train(run)
    end_valid = _validate(run, run.end_step)
    if run.cfg.save:
        _save(run, run.end_step)
    png = run.writer.close(f"{run.model_config.num_layers} layers, hidden {run.model_config.hidden_size}")
    seconds = time.perf_counter() - t_start
    run.log(f"validation loss: start {start_valid:.3f}, end {end_valid:.3f} nats per {run.unit}")
    run.log(f"steps {run.start_step}..{run.end_step} of {cfg.train_iters} in {seconds:.0f} s; metrics and "
            f"{png and png.name} in {cfg.output_dir}")
    return RunSummary(start_valid, end_valid, train_losses, seconds)


def _set_up(model_config: TransformerConfig, cfg: TrainingConfig, log, pg: ProcessGroupCollection | None) -> _Run:
    """Check the configs, build the data, the model and its optimizer, load a checkpoint and open the writer."""
    if pg is not None:
        check_ranks_agree(model=model_config, training=cfg)
    is_logger = pg is None or dist.get_rank() == 0
    if not is_logger:
        log = _silent
    model_config, cfg, notes = resolve_fast_path(model_config, cfg, pg, training_device(pg))
    for note in notes:
        log(f"fast path: {note}")
    if cfg.save:
        check_save_dir(cfg.save)  # fail now, not at the first save after hours of training
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"vocab_size: the tokenizer's ids need {tokenizer.vocab_size} embedding rows (its largest id "
                         f"is {tokenizer.vocab_size - 1}), the model's vocab_size is {model_config.vocab_size}")
    data = build_datasets(cfg, tokenizer, model_config.seq_length, model_config.vocab_size)
    state = setup_training(model_config, cfg, pg)
    if pg is not None:
        log(f"parallel: {dist.get_world_size()} ranks ({dist.get_backend()}), TP {pg.tp_size}"
            f"{' (SP)' if pg.tp_size > 1 else ''}, DP {pg.dp_size}, "
            f"EP {pg.ep_size}, ETP {pg.expt_tp_size}, expert-DP {pg.expt_dp_size}, "
            f"{'FSDP2' if cfg.use_torch_fsdp2 else 'DDP'}")
    with torch.device("meta"):
        whole = GPTModel(model_config.single_process())
    log(f"model: {whole.num_parameters() / 1e6:.2f}M parameters, "
        f"{whole.num_parameters(active=True) / 1e6:.2f}M active; "
        f"corpus: {data['train'].num_tokens:,} train / {data['valid'].num_tokens:,} valid {tokenizer.unit}s")
    start_step = _load(model_config, cfg, state, pg, log)
    end_step = cfg.train_iters
    if cfg.exit_interval:
        end_step = min(end_step, (start_step // cfg.exit_interval + 1) * cfg.exit_interval)
    resumed = cfg.load and not (cfg.finetune or cfg.load_partial)
    writer = (MetricsWriter(cfg.output_dir, cfg.tensorboard_dir, resume_step=start_step if resumed else None)
              if is_logger else _NoWriter())
    return _Run(model_config, cfg, pg, log, state, data, tokenizer.unit, whole, start_step, end_step, writer,
                is_logger)


def _load(model_config: TransformerConfig, cfg: TrainingConfig, state: TrainingState,
          pg: ProcessGroupCollection | None, log) -> int:
    """Load ``cfg.load`` (weights only when fine-tuning); the step to start from."""
    start_step = 0
    if cfg.load and cfg.finetune:
        load_model_weights(cfg.load, state.model, pg, model_config=model_config, partial=cfg.load_partial,
                           log=log)
    elif cfg.load:
        start_step = load_checkpoint(cfg.load, state.model, state.optimizer, state.scheduler, pg, seed=cfg.seed,
                                     model_config=model_config, partial=cfg.load_partial, log=log)
    if start_step > cfg.train_iters:
        raise ValueError(f"train_iters ({cfg.train_iters}) is below the step of the checkpoint in {cfg.load} "
                         f"({start_step})")
    return start_step


def _train(run: _Run) -> list[float]:
    """Steps ``start_step .. end_step``: train, log every ``log_interval``, evaluate and save between; the losses."""
    cfg, state = run.cfg, run.state
    train_losses = []
    skipped_steps = 0
    state.model.train()
    window = _LogWindow()
    bar = tqdm(range(run.start_step, run.end_step), desc="pretrain", unit="step", dynamic_ncols=True,
               mininterval=2.0, disable=not run.is_logger)
    make = functools.partial(run.data["train"].batch, state.tokens_per_step // run.model_config.seq_length,
                             cfg.seed, rank=state.dp_rank, world=state.dp_size)
    batches = Prefetcher(make, range(run.start_step, run.end_step), state.device)
    for step in bar:
        batch, waited = batches.next()
        window.data_wait += waited
        step_loss, grad_norm, skipped = train_step(state, *batch)
        loss_value = step_loss.item()
        train_losses.append(loss_value)
        window.steps += 1
        done = step + 1
        if skipped:
            skipped_steps += 1
            _check_skipped(run, done, loss_value, grad_norm, skipped_steps)
        if done % cfg.log_interval == 0 or done == run.end_step:
            tokens_per_second = _log_step(run, done, window, loss_value, grad_norm, skipped_steps)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_second:,.0f}")
            window = _LogWindow()
        with window.paused():
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done != run.end_step:
                _validate(run, done)
            if cfg.save and cfg.save_interval and done % cfg.save_interval == 0 and done != run.end_step:
                _save(run, done)
    bar.close()
    batches.close()
    return train_losses


def _check_skipped(run: _Run, done: int, loss_value: float, grad_norm: torch.Tensor, skipped_steps: int) -> None:
    """Log a skipped step; raise ``TrainingDivergedError`` past ``max_skipped_steps``."""
    limit = run.cfg.max_skipped_steps
    run.log(f"step {done}: skipped, loss {loss_value} and gradient norm {grad_norm.item()} must be finite; "
            f"{skipped_steps} skipped in this run (max_skipped_steps {limit})")
    if skipped_steps > limit:
        raise TrainingDivergedError(
            f"training diverged: {skipped_steps} steps had a non-finite loss or gradient norm, more than "
            f"max_skipped_steps ({limit}); stopped at step {done} without saving (the last checkpoint holds "
            "finite weights)"
        )


def _log_step(run: _Run, done: int, window: _LogWindow, loss_value: float, grad_norm: torch.Tensor,
              skipped_steps: int) -> float:
    """Write the training row of step ``done`` (collective: every rank computes it); its tokens per second."""
    state, pg = run.state, run.pg
    elapsed = time.perf_counter() - window.start
    tokens_per_second = window.steps * state.tokens_per_step / elapsed
    # "lr": the rate the next step will use (what Megatron logs), min_lr after the last step.
    metrics = {"loss": loss_value, "grad_norm": grad_norm.item(), "lr": state.scheduler.get_last_lr()[0],
               "tokens_per_second": tokens_per_second, "skipped_steps": skipped_steps,
               # Time the step waited for its batch (Prefetcher), per step and as a share of the time.
               "data_wait_ms": 1e3 * window.data_wait / window.steps, "data_wait_fraction": window.data_wait / elapsed}
    cfg = run.model_config
    report = routing_report(state.model.moe_layers(), pg,
                            [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)])
    if report is not None:
        metrics.update(report.metrics())
    gpus = state.dp_size * (1 if pg is None else pg.tp_size)
    # Model TFLOP/s per GPU as Megatron counts them, to compare with its published figures.
    per_gpu = tokens_per_second / gpus
    metrics["megatron_tflops_per_gpu"] = megatron_flops_per_token(cfg) * per_gpu / 1e12
    utilisation = mfu(run.whole.flops_per_token(), per_gpu, state.device)
    if utilisation is not None:
        metrics["mfu"] = utilisation
    if state.device.type == "cuda":
        metrics["peak_memory_gib"] = peak_memory_gib(state.device, pg)
    run.writer.log(done, metrics)
    return tokens_per_second


def _validate(run: _Run, step: int) -> float:
    """Evaluate (``evaluate``) and write the validation row of ``step``; the loss."""
    loss = evaluate(run.state, run.data["valid"], run.cfg)
    run.writer.log(step, {"valid_loss": loss})
    return loss


def _save(run: _Run, step: int) -> None:
    """Save the checkpoint of ``step`` to ``cfg.save``."""
    state, cfg = run.state, run.cfg
    save_checkpoint(cfg.save, state.model, state.optimizer, state.scheduler, step, run.pg, seed=cfg.seed,
                    model_config=run.model_config, keep=cfg.save_keep)


def _silent(*_args, **_kwargs) -> None:
    """``log`` of the ranks other than 0."""


class _NoWriter:
    """``MetricsWriter`` of the ranks other than 0: writes nothing."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self, title: str) -> None:
        return None


__all__ = ["pretrain", "RunSummary", "TrainingDivergedError", "evaluate", "mfu", "peak_memory_gib"]
