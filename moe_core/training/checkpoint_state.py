"""state.json, a checkpoint's non-tensor state, checked field by field before a load reads a tensor.

    format                  FORMAT
    step                    training steps done (skipped non-finite ones included): an int >= 0
    seed                    the data seed: an int >= 0
    scheduler               the LR schedule's ``state_dict()``: ``base_lrs`` (each param group's peak lr, > 0),
                            ``_last_lr`` (>= 0, one per group), ``last_epoch`` (an int >= 0), ``lr_lambdas``
                            (null each: the schedule itself is code, rebuilt from the run's flags) and torch's
                            bookkeeping (plain values of the types the live scheduler's have)
    optimizer_param_groups  AdamW's param groups, one per ``base_lrs`` entry: ``lr`` >= 0, ``initial_lr`` > 0,
                            ``betas`` two numbers in [0, 1), ``eps`` > 0, ``weight_decay`` >= 0, AdamW's flags
                            booleans (``foreach`` and ``fused`` also null)
    model_config            ``dataclasses.asdict`` of the ``TransformerConfig``, or null
    world_size, torch_version   for the record, never read

A resume (``check_resumable``) also needs the run's schedule: as many param groups, the run's ``lr`` as each
group's peak (the loaded ``LambdaLR`` scales the run's schedule shape by the saved ``base_lrs``: another peak
gives a schedule of neither run) and no scheduler field the live scheduler lacks (``load_state_dict`` sets each
as an attribute).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_core.config import INT64_MAX, check_number
from moe_core.training.checkpoint_files import CheckpointError

FORMAT = "moe_core.checkpoint.v2"
_SCHEDULE = frozenset({"base_lrs", "_last_lr", "last_epoch", "lr_lambdas"})
_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")
_OPTIONAL_FLAGS = ("foreach", "fused")


def _expect(name: str, value: Any, kind: type | tuple[type, ...], expected: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} ({value!r})")
    return value


def _count(name: str, value: Any) -> int:
    if not 0 <= _expect(name, value, int, "an int") <= INT64_MAX:
        raise ValueError(f"{name}: expected an int >= 0 and <= 2**63 - 1, got {value}")
    return value


def _numbers(name: str, value: Any, length: int | None = None, **bounds) -> list[float]:
    if not isinstance(value, list) or length is not None and len(value) != length:
        count = "a list" if length is None else f"a list of {length}"
        raise TypeError(f"{name}: expected {count} numbers, got {value!r}")
    return [check_number(f"{name}[{i}]", v, **bounds) for i, v in enumerate(value)]


def _check_group(name: str, group: Any) -> None:
    _expect(name, group, dict, "an object")
    check_number(f"{name}.lr", group.get("lr"), low=0.0)
    check_number(f"{name}.initial_lr", group.get("initial_lr"), low=0.0, low_open=True)
    check_number(f"{name}.eps", group.get("eps"), low=0.0, low_open=True)
    check_number(f"{name}.weight_decay", group.get("weight_decay"), low=0.0)
    _numbers(f"{name}.betas", group.get("betas"), 2, low=0.0, high=1.0, high_open=True)
    for flag in _FLAGS:
        if flag in group:
            _expect(f"{name}.{flag}", group[flag], bool, "true or false")
    for flag in _OPTIONAL_FLAGS:
        if group.get(flag) is not None:
            _expect(f"{name}.{flag}", group[flag], bool, "true, false or null")


def _check_fields(state: dict) -> None:
    _count("step", state.get("step"))
    _count("seed", state.get("seed"))
    if state.get("model_config") is not None:
        _expect("model_config", state["model_config"], dict, "an object or null")
    scheduler = _expect("scheduler", state.get("scheduler"), dict, "an object")
    groups = len(_numbers("scheduler.base_lrs", scheduler.get("base_lrs"), low=0.0, low_open=True))
    _numbers("scheduler._last_lr", scheduler.get("_last_lr"), groups, low=0.0)
    _count("scheduler.last_epoch", scheduler.get("last_epoch"))
    if scheduler.get("lr_lambdas") != [None] * groups:
        raise ValueError(f"scheduler.lr_lambdas: expected {groups} nulls (one per param group), got "
                         f"{scheduler.get('lr_lambdas')!r}")
    param_groups = _expect("optimizer_param_groups", state.get("optimizer_param_groups"), list, "a list")
    if len(param_groups) != groups:
        raise ValueError(f"optimizer_param_groups: expected {groups} (one per scheduler.base_lrs entry), got "
                         f"{len(param_groups)}")
    for i, group in enumerate(param_groups):
        _check_group(f"optimizer_param_groups[{i}]", group)


def read_state(path: Path) -> dict:
    """The checked content of ``path``, a checkpoint's state.json (module docstring).

    Raises:
        CheckpointError: not JSON, another format, or a field of another type or outside its range (naming
            ``path``, the field, what was expected and what came).
    """
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"load: {path} is not JSON: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"load: {path} is not a {FORMAT} state")
    try:
        _check_fields(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"load: {path}: {e}") from None
    return state


def check_resumable(path: Path, state: dict, scheduler: dict, param_groups: list[dict]) -> None:
    """Raise ``CheckpointError`` (naming ``path`` and the field) unless ``state`` (``read_state``'s) continues
    the run of the live scheduler's ``state_dict()`` and optimizer's ``param_groups`` (module docstring)."""
    saved = state["scheduler"]
    if len(saved["base_lrs"]) != len(param_groups):
        raise CheckpointError(f"load: {path}: optimizer_param_groups: {len(saved['base_lrs'])} param groups, the "
                              f"optimizer has {len(param_groups)}")
    if saved["base_lrs"] != scheduler["base_lrs"]:
        raise CheckpointError(f"load: {path}: scheduler.base_lrs: the checkpoint's schedule peaks at "
                              f"{saved['base_lrs']}, this run's at {scheduler['base_lrs']} (lr): resume with the "
                              "checkpoint's lr, or take its weights into a new schedule with finetune (--finetune)")
    for key in sorted(set(saved) - _SCHEDULE):
        if key not in scheduler:
            raise CheckpointError(f"load: {path}: scheduler.{key}: not a field of this run's LR scheduler "
                                  f"(it has {sorted(scheduler)})")
        if type(saved[key]) is not type(scheduler[key]):
            raise CheckpointError(f"load: {path}: scheduler.{key}: expected a {type(scheduler[key]).__name__}, got "
                                  f"{saved[key]!r}")


__all__ = ["FORMAT", "read_state", "check_resumable"]
