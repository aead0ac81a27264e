"""Checkpoints that would run code, or that changed on disk, fail to load with an error naming the problem,
and load nothing: a crafted .metadata, a non-tensor entry, flipped and truncated files, a broken manifest, a
state.json field of another type or out of its range (with the manifest rewritten to match).

Each crafted payload is first shown to be live: torch's own reader runs it (the marker file appears)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe_core.training import checkpoint_files as files
from moe_core.training.checkpoint import FORMAT, CheckpointError, load_checkpoint, save_checkpoint
from moe_core.training.step import setup_training
from tests.reliability._common import TINY, parse


class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): a stand-in for any code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _state(tmp_path: Path):
    model, training = parse(TINY + ["--output-dir", str(tmp_path / "out")])
    return model, training, setup_training(model, training)


@pytest.fixture
def saved(tmp_path):
    """A real checkpoint of the tiny GPT (step 3) and a fresh training state to load it into."""
    model, training, state = _state(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", state.model, state.optimizer, state.scheduler, 3, seed=training.seed,
                           model_config=model)
    return path, model, training, _state(tmp_path)[2]


def _load(path, model, training, state):
    return load_checkpoint(path, state.model, state.optimizer, state.scheduler, seed=training.seed,
                           model_config=model)


def _rewrite_manifest(directory: Path) -> None:
    """What an attacker with write access does: make the manifest match the crafted files."""
    names = sorted(p.name for p in directory.iterdir() if p.name != files.MANIFEST)
    manifest = {"format": FORMAT, "files": files.digest_files(directory, names)}
    (directory / files.MANIFEST).write_text(json.dumps(manifest))


def _params(state) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def test_crafted_metadata_runs_nothing(saved, tmp_path):
    path, model, training, state = saved
    marker = tmp_path / "pwned"
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data = {"payload": Payload(marker)}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(path)
    control = tmp_path / "control"
    shutil.copytree(path, control)
    dcp.FileSystemReader(control).read_metadata()  # torch's reader unpickles: the payload is live
    assert marker.exists()
    marker.unlink()

    before = _params(state)
    with pytest.raises(CheckpointError, match=r"\.metadata is unsafe .* global io\.open is not allowed"):
        _load(path, model, training, state)
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in _params(state).items())


def test_crafted_non_tensor_entry_runs_nothing(saved, tmp_path):
    """A tensor of the model saved as a pickled object: DCP would torch.load it with weights_only=False."""
    path, model, training, state = saved
    marker = tmp_path / "pwned"
    model_sd = {k: v.detach() for k, v in state.model.state_dict().items()}
    victim = sorted(model_sd)[0]
    dcp.save({"model": {**model_sd, victim: Payload(marker)}}, checkpoint_id=path)
    _rewrite_manifest(path)
    assert not marker.exists()
    control = dict(model_sd)
    dcp.load({"model": control}, checkpoint_id=path)  # torch's planner unpickles the entry: the payload is live
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CheckpointError, match=rf"entry 'model\.{victim}' is BytesStorageMetadata"):
        _load(path, model, training, state)
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint(saved, tmp_path):
    path, model, training, state = saved
    metadata = pickle.loads((path / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=r"points at '\.\./elsewhere\.distcp', which is not a file of the"):
        _load(path, model, training, state)


def test_a_plain_dcp_directory_is_not_loaded(saved, tmp_path):
    """A DCP directory without manifest (another tool's, or moe_core's older layout) with a crafted .metadata."""
    path, model, training, state = saved
    marker = tmp_path / "pwned"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*plain"):
        _load(plain, model, training, state)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "delete"])
def test_a_damaged_data_file_is_named(saved, damage):
    path, model, training, state = saved
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if damage == "flip":  # 64 bytes in the middle: the size stays, the values change
        middle = len(raw) // 2
        raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(bytes(raw[:len(raw) // 3]))
    elif damage == "empty":
        data.write_bytes(b"")
    else:
        data.unlink()
    before = _params(state)
    expected = {"flip": "does not match its SHA-256", "truncate": r"has \d+ bytes, the manifest says \d+",
                "empty": "has 0 bytes", "delete": "is missing"}[damage]
    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp {expected}"):
        _load(path, model, training, state)
    assert all(torch.equal(before[k], v) for k, v in _params(state).items())


@pytest.mark.parametrize("name, content, message", [
    (files.MANIFEST, b"{not json", r"manifest\.json is corrupt"),
    (files.STATE, b'{"format": "' + FORMAT.encode() + b'", "step": 3}  ', r"state\.json has \d+ bytes"),
    (".metadata", b"\x80\x04", r"\.metadata has 2 bytes"),
])
def test_damaged_small_files_are_named(saved, name, content, message):
    path, model, training, state = saved
    (path / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        _load(path, model, training, state)


NAN = float("nan")
# (field of state.json, the value written, the error's text after "state.json: ")
STATE_FIELDS = [
    ("step", "3", r"step: expected an int, got str \('3'\)"),
    ("step", 3.0, r"step: expected an int, got float \(3\.0\)"),
    ("step", True, r"step: expected an int, got bool \(True\)"),
    ("step", -1, r"step: expected an int >= 0 and <= 2\*\*63 - 1, got -1"),
    ("seed", "1234", r"seed: expected an int, got str"),
    ("model_config", "tiny", r"model_config: expected an object or null, got str"),
    ("scheduler", None, r"scheduler: expected an object, got NoneType"),
    ("scheduler.base_lrs", [1e9] * 4, r"scheduler\.base_lrs: the checkpoint's schedule peaks at \[1000000000\.0, "
                                      r".*this run's at \[0\.01, 0\.01, 0\.01, 0\.01\] \(lr\): resume with"),
    ("scheduler.base_lrs", [-0.01] * 4, r"scheduler\.base_lrs\[0\]: expected a finite number > 0, got -0\.01"),
    ("scheduler.base_lrs", [NAN] * 4, r"scheduler\.base_lrs\[0\]: expected a finite number > 0, got nan"),
    ("scheduler.base_lrs", [0.01] * 3, r"scheduler\._last_lr: expected a list of 3 numbers, got \[0\.01, 0\.01, "),
    ("scheduler._last_lr", [0.01, 0.01, "0.01", 0.01], r"scheduler\._last_lr\[2\]: expected a number, got str"),
    ("scheduler.last_epoch", 0.5, r"scheduler\.last_epoch: expected an int, got float"),
    ("scheduler.lr_lambdas", [{"lr": 1}, None, None, None], r"scheduler\.lr_lambdas: expected 4 nulls"),
    ("scheduler.optimizer", 5, r"scheduler\.optimizer: not a field of this run's LR scheduler"),
    ("scheduler._is_initial", 1, r"scheduler\._is_initial: expected a bool, got 1"),
    ("optimizer_param_groups.0.lr", -1.0, r"optimizer_param_groups\[0\]\.lr: expected a finite number >= 0, got -1"),
    ("optimizer_param_groups.1.lr", NAN, r"optimizer_param_groups\[1\]\.lr: expected a finite number >= 0, got nan"),
    ("optimizer_param_groups.2.initial_lr", "1e-2", r"optimizer_param_groups\[2\]\.initial_lr: expected a number"),
    ("optimizer_param_groups.0.betas", [0.9, 1.0], r"optimizer_param_groups\[0\]\.betas\[1\]: expected a finite "
                                                   r"number >= 0 and < 1, got 1"),
    ("optimizer_param_groups.0.betas", [0.9], r"optimizer_param_groups\[0\]\.betas: expected a list of 2 numbers"),
    ("optimizer_param_groups.0.eps", 0, r"optimizer_param_groups\[0\]\.eps: expected a finite number > 0, got 0"),
    ("optimizer_param_groups.0.weight_decay", 1e999, r"optimizer_param_groups\[0\]\.weight_decay: expected a "
                                                     r"finite number >= 0, got inf"),
    ("optimizer_param_groups.0.amsgrad", "false", r"optimizer_param_groups\[0\]\.amsgrad: expected true or false"),
    ("optimizer_param_groups.3.fused", 1, r"optimizer_param_groups\[3\]\.fused: expected true, false or null"),
    ("optimizer_param_groups", {}, r"optimizer_param_groups: expected a list, got dict"),
]


@pytest.mark.parametrize("field, value, message", STATE_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in STATE_FIELDS])
def test_a_state_field_of_another_type_or_range_is_named(saved, field, value, message):
    path, model, training, state = saved
    content = json.loads((path / files.STATE).read_text())
    *parents, last = field.split(".")
    target = content
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    target[int(last) if isinstance(target, list) else last] = value
    (path / files.STATE).write_text(json.dumps(content))
    _rewrite_manifest(path)
    before = _params(state)
    with pytest.raises(CheckpointError, match=rf"load: {path / files.STATE}: {message}"):
        _load(path, model, training, state)
    assert all(torch.equal(before[k], v) for k, v in _params(state).items())
