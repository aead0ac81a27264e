"""Checkpoints that load in any process layout, are published atomically and never run code when loaded.

Layout and publication: ``checkpoint_files`` (``save/step_<N>/``, a ``latest`` pointer, the last ``keep``
kept, a SHA-256 manifest). Safety of loading: ``checkpoint_metadata`` (DCP's pickle), ``checkpoint_state``
(state.json's fields).

What a checkpoint holds:

- DCP (torch.distributed.checkpoint), tensors only: the model, AdamW's per-parameter state and each rank's
  torch RNG states (CPU, and CUDA when used: router input jitter draws from them) under a per-rank key, so
  ranks with different streams don't collapse into one replicated entry; a rank without its own entry (another
  world size) keeps its freshly seeded RNG.
- state.json: the step (training steps done, skipped non-finite ones included), the data seed (batches are a function
  of ``(seed, step)``, ``data.TokenWindows.batch``), the LR schedule's state, AdamW's param groups
  (hyper-parameters), the model's ``TransformerConfig``, and for the record the world size and torch version.

The tensors are saved sharded, each rank writing only what it holds, in the single-process layout
(``checkpoint_layout``): every parameter and AdamW moment is a DTensor view of this rank's shard (TP, ETP,
FSDP2) placed in the single-process tensor, expert tensors with their EP rank's experts at rows
``[r * L, (r + 1) * L)`` of ``[E, ...]``, a gated fc1 with a ``[gate, up]`` section axis. No rank gathers a
full state dict, on save or load, and DCP reads any other layout's shards (TP, EP, FSDP2 or DP sizes, one
process) by their offsets. A checkpoint that names ``GroupedMLP``'s linears ``fc1`` / ``fc2`` loads into
``linear_fc1`` / ``linear_fc2`` (``checkpoint_layout.as_saved``).

Loading checks, in order, before any tensor is read: the manifest (sizes and SHA-256 of every file), the type
and range of every field of state.json, the architecture (``TransformerConfig`` fields outside
``RESUMABLE_FIELDS`` must be equal, and recorded, unless ``partial``), the allow-list unpickling of
``.metadata``, then for a resume the seed and the schedule (``checkpoint_state.check_resumable``). After the
read, every floating-point tensor read (weights, buffers, AdamW's moments and step) must be finite. A checkpoint
with a non-finite weight or moment is never written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from moe_core.config import TransformerConfig
from moe_core.training import checkpoint_files as files
from moe_core.training.checkpoint_files import CheckpointError
from moe_core.training.checkpoint_layout import as_saved, layouts, model_views, optimizer_views
from moe_core.training.checkpoint_metadata import VerifiedReader, read_metadata
from moe_core.training.checkpoint_state import FORMAT, check_resumable, read_state

_OPTIONS = StateDictOptions(full_state_dict=False)  # sharded: each rank's own DTensor shards
# TransformerConfig fields a checkpoint may be loaded under with other values: the parallel layout and
# settings of training, not of the function the weights compute. Every other field must match.
RESUMABLE_FIELDS = frozenset({
    "seq_length", "init_method_std", "moe_token_dispatcher_type", "moe_dispatch_sync_free", "moe_router_dtype",
    "moe_router_bias_update_rate", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_input_jitter_eps", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_shared_expert_overlap", "expert_model_parallel_size", "tensor_model_parallel_size", "sequence_parallel",
    "expert_tensor_parallel_size", "cross_entropy_chunk_size", "moe_apply_probs_on_output",
})


def _rng_key() -> str:
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def _rng_state() -> dict[str, torch.Tensor]:
    """This process's torch RNG states: ``cpu`` (and ``cuda``, the current device's, once CUDA is in use)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 only; its result, or its exception, on every rank (a broadcast), so all ranks leave
    together and none waits in a later collective for a rank that failed."""
    if not dist.is_initialized():
        return fn()
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [(True, fn())]
        except Exception as e:  # noqa: BLE001 - every rank re-raises it below
            outcome = [(False, e)]
    dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _shared_over_ranks(items: list[str], fn: Callable[[list[str]], dict]) -> dict:
    """The union of ``fn(share)`` over the ranks, each rank taking every world-size-th item (file hashing)."""
    if not dist.is_initialized():
        return fn(items)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, fn(items[dist.get_rank()::dist.get_world_size()]))
    return {k: v for part in parts for k, v in part.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested state dict's leaves by DCP's key (``model.<name>``, ``optim.state.<name>.exp_avg``)."""
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _first_non_finite(tree: dict) -> str | None:
    """The key of the first floating-point tensor of ``tree`` (a nested state dict; a DTensor by this rank's
    shard) that holds NaN or Inf on any rank, or None. One pass (a multi-tensor max |x| per device and dtype) and
    one host sync; collective over all ranks (one all-reduce, and an all-gather of the keys once one is found)."""
    locals_ = {k: _local(v) for k, v in _flatten(tree).items() if isinstance(v, torch.Tensor)}
    named = {k: v for k, v in locals_.items() if v.is_floating_point() and v.numel()}  # a shard may be empty
    if dist.is_initialized():
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    else:
        device = next((v.device for v in named.values() if v.is_cuda), torch.device("cpu"))
    batches: dict[tuple, dict[str, torch.Tensor]] = {}
    for key, tensor in named.items():
        batches.setdefault((tensor.device, tensor.dtype), {})[key] = tensor
    maxima = {key: m for batch in batches.values()
              for key, m in zip(batch, torch._foreach_norm(list(batch.values()), math.inf), strict=True)}
    # A host-to-device copy need not wait (its source is read at once); the other way round would have to.
    moved = [maxima[k].float().to(device, non_blocking=device.type == "cuda") for k in named]
    finite = (torch.stack(moved) if moved else torch.zeros(0, device=device)).isfinite()  # [tensors] bool
    bad = (~finite).any().int()
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return None
    first = next((k for k, ok in zip(named, finite.tolist(), strict=True) if not ok), None)
    if not dist.is_initialized():
        return first
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, first)
    return next(key for key in keys if key is not None)


def save_checkpoint(save_dir: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, pg_collection=None, *,
                    seed: int, model_config: TransformerConfig | None = None, keep: int = 2) -> Path:
    """Write the checkpoint of ``step`` (module docstring) to ``save_dir/step_<step>/`` atomically, point
    ``save_dir/latest`` at it and keep the ``keep`` of the highest steps. Collective over all ranks (which
    must share the file system). Returns the checkpoint's directory.

    Raises:
        RuntimeError: a weight or optimizer moment is not finite (nothing is written).
        ValueError: ``save_dir`` holds a ``step_<N>`` that is no checkpoint, or a ``latest`` that is no file
            (naming it; nothing is written).
        OSError: the file system refused, naming the checkpoint, the file and, errno ENOSPC, that the disk is full
            (the previous checkpoints are untouched, ``latest`` names the last of them).
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    layout = layouts(model, pg_collection)
    tensors = {"model": model_views(model_sd, layout, pg_collection),
               "optim": {"state": optimizer_views(optim_sd["state"], layout, pg_collection)},
               "rng": {_rng_key(): _rng_state()}}
    bad = _first_non_finite(tensors)
    if bad is not None:
        raise RuntimeError(f"save_checkpoint: refusing to save step {step}: {bad} holds NaN or Inf (the previous "
                           "checkpoint stays the latest)")
    state = {
        "format": FORMAT, "step": step, "seed": seed, "scheduler": scheduler.state_dict(),
        "optimizer_param_groups": optim_sd["param_groups"],
        "model_config": None if model_config is None else dataclasses.asdict(model_config),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1, "torch_version": torch.__version__,
    }
    state_json = json.dumps(state, indent=1, allow_nan=False).encode()
    tmp = _on_rank0(lambda: files.prepare_step_dir(save_dir, step))
    try:
        dcp.save(tensors, storage_writer=files.dcp_writer(tmp))
        _on_rank0(lambda: files.write_durably(tmp / files.STATE, state_json))
        digests = _shared_over_ranks(sorted(p.name for p in tmp.iterdir()),
                                     lambda names: files.digest_files(tmp, names))
        manifest = json.dumps({"format": FORMAT, "files": dict(sorted(digests.items()))}, indent=1).encode()
        _on_rank0(lambda: files.write_durably(tmp / files.MANIFEST, manifest))
    except (OSError, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = files.save_error(Path(save_dir) / files.step_dir_name(step), e)
        if error is None:
            raise
        raise error from e
    return _on_rank0(lambda: files.publish(tmp, keep))


def architecture_differences(saved: dict | None, current: TransformerConfig | None) -> dict[str, tuple]:
    """``{field: (checkpoint's value, current value)}`` of the fields outside ``RESUMABLE_FIELDS`` that differ;
    empty when either config is unknown. A field the checkpoint predates counts with its default."""
    if saved is None or current is None:
        return {}
    diffs = {}
    for field in dataclasses.fields(current):
        if field.name in RESUMABLE_FIELDS:
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        before, now = saved.get(field.name, default), getattr(current, field.name)
        if before != now:
            diffs[field.name] = (before, now)
    return diffs


def _restore_groups(saved_groups: list[dict], live_groups: list[dict]) -> list[dict]:
    """AdamW's param groups: the saved hyper-parameters (lists back to tuples where the live optimizer has
    tuples: betas) over the live groups' parameter names (another layout names other local experts)."""
    return [{**{k: tuple(v) if isinstance(live.get(k), tuple) else v for k, v in saved.items()},
             "params": live["params"]} for saved, live in zip(saved_groups, live_groups, strict=True)]


def _read_state(directory: Path, manifest: dict) -> dict:
    """Verify every file against the manifest (split over the ranks), then read and check state.json."""
    def check(names: list[str]) -> dict[str, list[str]]:
        return {name: found for name in names if (found := files.check_files(directory, {name: manifest[name]}))}

    problems = _shared_over_ranks(sorted(manifest), check)
    if problems:
        raise CheckpointError(f"load: {directory} is corrupt: " + "; ".join(m for ms in problems.values() for m in ms))
    return read_state(directory / files.STATE)


def _check_architecture(directory: Path, saved: dict | None, model_config: TransformerConfig | None,
                        partial: bool) -> str:
    """The architecture differences between the checkpoint's recorded config ``saved`` and ``model_config``
    as text ('' when none or ``model_config`` is None). Without ``partial`` a difference, or no recorded config,
    raises ``CheckpointError``."""
    if model_config is None:
        return ""
    if saved is None:
        if partial:
            return f"unknown ({files.STATE} records no model config)"
        raise CheckpointError(f"load: {directory / files.STATE} records no model config (model_config is null), so "
                              "its architecture cannot be compared with this run's; re-import the checkpoint "
                              "(tools/hf_checkpoint.py import records it) or pass load_partial (--load-partial) to "
                              "load the weights whose names and shapes match")
    listed = ", ".join(f"{k}: {before!r} in the checkpoint, {now!r} now"
                       for k, (before, now) in architecture_differences(saved, model_config).items())
    if listed and not partial:
        raise CheckpointError(f"load: {directory} holds another architecture ({listed}); pass load_partial "
                              "(--load-partial) to load the matching weights only")
    return listed


def _open_checkpoint(path: str | os.PathLike, model_config: TransformerConfig | None, partial: bool,
                     log: Callable[[str], None]) -> tuple[Path, dict, Any, str]:
    """Resolve ``path``, verify every file against the manifest, read state.json, check the architecture
    (``_check_architecture``) and unpickle the allow-listed ``.metadata``: ``(directory, state, metadata,
    architecture differences as text)``."""
    directory, note = files.resolve_checkpoint(path)
    if note:
        log(f"load: {note}")
    manifest = files.read_manifest(directory)
    state = _read_state(directory, manifest)
    diffs = _check_architecture(directory, state["model_config"], model_config, partial)
    return directory, state, read_metadata(directory, set(manifest)), diffs


def _read_tensors(directory: Path, tensors: dict, metadata: Any) -> None:
    """``dcp.load`` of ``tensors`` (in place) from the checked ``metadata``, then refuse a non-finite one."""
    dcp.load(tensors, storage_reader=VerifiedReader(directory, metadata))
    bad = _first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"load: {bad} in {directory} holds NaN or Inf (save_checkpoint never writes one: the "
                              "files were written by another tool or changed with their manifest); load another "
                              "checkpoint")


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, pg_collection=None, *,
                    seed: int | None = None, model_config: TransformerConfig | None = None, partial: bool = False,
                    log: Callable[[str], None] | None = None) -> int:
    """Restore what ``save_checkpoint`` wrote (in any layout) into the given objects and this rank's RNG
    states; returns the step to continue from.

    Args:
        path: a save directory (its ``latest``, or its newest complete checkpoint when ``latest`` is unusable)
            or one ``step_<N>/`` directory.
        seed: the run's data seed, checked against the checkpoint's (None: not checked).
        model_config: the run's architecture, checked against the checkpoint's, which must be recorded (None:
            not checked).
        partial: ``load_model_weights(partial=True)``: load only the model tensors whose names and full shapes
            match, whatever the architecture; the optimizer, schedule, RNG and step stay fresh and the return
            value is 0.
        log: receives notes (a ``latest`` that could not be followed, what a partial load skipped).
    Raises:
        CheckpointError (a ValueError): no complete checkpoint, a missing or corrupt file (named), a field of
            state.json of another type or out of its range, an unsafe ``.metadata``, without ``partial`` another
            architecture (naming the fields) or none recorded, another seed, another schedule (``lr``; see
            ``checkpoint_state.check_resumable``), or a tensor holding NaN or Inf (named; the model and optimizer
            then hold what was read).
    """
    log = log or (lambda _msg: None)
    if partial:
        load_model_weights(path, model, pg_collection, model_config=model_config, partial=True, log=log)
        return 0
    directory, state, metadata, _ = _open_checkpoint(path, model_config, False, log)
    if seed is not None and state["seed"] != seed:
        raise CheckpointError(f"seed: the checkpoint in {directory} was trained with seed {state['seed']}, "
                              f"got {seed}")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    check_resumable(directory / files.STATE, state, scheduler.state_dict(), optim_sd["param_groups"])
    layout = as_saved(layouts(model, pg_collection), set(_saved_model_shapes(metadata)))
    # The views share storage with model_sd / optim_sd's tensors (the live shards): dcp.load fills them in place.
    tensors = {"model": model_views(model_sd, layout, pg_collection),
               "optim": {"state": optimizer_views(optim_sd["state"], layout, pg_collection)}}
    # Only the RNG entries this checkpoint has: another world size, or no CUDA when it was saved.
    rng = {k: v for k, v in _rng_state().items() if f"rng.{_rng_key()}.{k}" in metadata.state_dict_metadata}
    if rng:
        tensors["rng"] = {_rng_key(): rng}
    _read_tensors(directory, tensors, metadata)
    optim_sd = {"state": optim_sd["state"],
                "param_groups": _restore_groups(state["optimizer_param_groups"], optim_sd["param_groups"])}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
    scheduler.load_state_dict(state["scheduler"])
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    return state["step"]


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module, pg_collection=None, *,
                       model_config: TransformerConfig | None = None, partial: bool = False,
                       log: Callable[[str], None] | None = None) -> None:
    """Restore only the model's weights from a checkpoint (Megatron's ``--finetune``): the optimizer, schedule,
    step, seed and RNG states stay fresh. Any process layout, like ``load_checkpoint``, and the same checks
    (manifest, state.json, allow-listed ``.metadata``, the architecture when ``model_config`` is given, finite
    values).

    Args:
        partial: load only the weights whose names and full shapes match, whatever the architecture; ``log``
            receives what was kept fresh.
    Raises:
        CheckpointError (a ValueError): as ``load_checkpoint``; also, without ``partial``, a weight the
            checkpoint lacks or holds in another shape.
    """
    log = log or (lambda _msg: None)
    directory, _, metadata, diffs = _open_checkpoint(path, model_config, partial, log)
    model_sd = get_model_state_dict(model, options=_OPTIONS)
    saved = _saved_model_shapes(metadata)
    # The views share storage with model_sd's tensors (the live shards): dcp.load fills them in place.
    views = model_views(model_sd, as_saved(layouts(model, pg_collection), set(saved)), pg_collection)
    matching = {k: v for k, v in views.items() if saved.get(k) == tuple(v.shape)}
    others = sorted(set(views) - set(matching))
    if others and not partial:
        listed = ", ".join(f"{k} {tuple(views[k].shape)} ({saved[k] if k in saved else 'missing'} in the checkpoint)"
                           for k in others)
        raise CheckpointError(f"load: {directory} does not hold the weights {listed}; pass load_partial "
                              "(--load-partial) to load the matching ones only")
    _read_tensors(directory, {"model": matching}, metadata)
    set_model_state_dict(model, model_sd, options=_OPTIONS)
    if partial:
        log(f"load: partial load of {directory}: {len(matching)} of {len(views)} tensors; kept fresh: "
            f"{others or 'none'}; architecture differences: {diffs or 'none'}")


def _saved_model_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """The model tensors a checkpoint's DCP ``metadata`` holds: ``{key: shape}``."""
    return {k[len("model."):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if k.startswith("model.")}


def check_save_dir(save_dir: str | os.PathLike) -> None:
    """Raise ``ValueError`` at start-up, on rank 0 and then every rank, when ``save_dir`` is not writable."""
    _on_rank0(lambda: files.check_writable(save_dir))


__all__ = ["save_checkpoint", "load_checkpoint", "load_model_weights", "check_save_dir", "architecture_differences",
           "CheckpointError",
           "RESUMABLE_FIELDS"]
