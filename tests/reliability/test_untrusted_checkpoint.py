"""Checkpoints that would run code, or that changed on disk, fail to load with an error naming the problem,
and load nothing: a crafted .metadata, a non-tensor entry, flipped and truncated files, a broken manifest.

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
