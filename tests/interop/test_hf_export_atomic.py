"""kill -9 at points of an export (``save_hf`` with a reference directory): the target holds the previous
complete export or nothing, never part of one; the next export deletes what the kill left and writes what an
export never killed writes, byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_core.interop.hf import load_hf, save_hf
from tests.interop._common import CASES, build_hf

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("_save_hf_with_fault.py")

# (fault, whether a previous export is there, what the target holds after the kill): the n-th call of a
# file operation during the export (_save_hf_with_fault.py).
KILLS = [
    ("save_file:2", False, "nothing"),  # the second of several shards half written
    ("copy:2", True, "previous"),  # a reference file (tokenizer) half copied
    ("rename:1", True, "previous"),  # everything written; the previous export not yet moved aside
    ("rename:2", True, "nothing"),  # the previous export moved aside, the new one not yet renamed in
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Mixtral in several shards beside tokenizer files (the reference's files an export copies)."""
    path = tmp_path_factory.mktemp("hf")
    build_hf(CASES["mixtral-gqa-hd16-e8k2"]()).save_pretrained(path, max_shard_size="8KB")
    (path / "tokenizer.json").write_text('{"model": {"vocab": {' + ", ".join(f'"t{i}": {i}' for i in range(128))
                                         + "}}}\n")
    (path / "tokenizer_config.json").write_text('{"model_max_length": 2048}\n')
    return path


def _files(path: Path) -> dict[str, bytes] | None:
    return None if not path.exists() else {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _export(hf_dir: Path, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """What _save_hf_with_fault.py does, in this process."""
    config, model = load_hf(hf_dir, dtype=dtype)
    save_hf(model, config, out, max_shard_size="8KB", reference=hf_dir, overwrite=True)


@pytest.fixture(scope="module")
def straight(hf_dir, tmp_path_factory):
    """The files of an export never killed."""
    out = tmp_path_factory.mktemp("straight") / "export"
    _export(hf_dir, out)
    files = _files(out)
    assert sum(name.endswith(".safetensors") for name in files) > 2 and "tokenizer.json" in files
    return files


@pytest.mark.parametrize("fault, previous, after", KILLS, ids=[f"{f}-{'over' if p else 'new'}" for f, p, _ in KILLS])
def test_kill_during_export_leaves_previous_or_nothing(hf_dir, straight, tmp_path, fault, previous, after):
    out = tmp_path / "export"
    if previous:
        _export(hf_dir, out, dtype=torch.bfloat16)  # another export: other bytes
    before = _files(out)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOE_CORE_FAULT": fault}
    killed = subprocess.run([sys.executable, str(RUNNER), str(hf_dir), str(out)], env=env, capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _files(out) == (before if after == "previous" else None)

    _export(hf_dir, out)
    assert _files(out) == straight
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # what the kill left is gone
