"""The files of a Hugging Face directory: JSON read with errors that name the file, the weight files a
directory's index names (never outside it), and directories written whole or not at all.

A written directory (an export, an import) is built in ``<out>.tmp`` beside ``out``, fsynced, and renamed
to ``out`` at the end, as checkpoints are (``training/checkpoint_files``): a process killed at any point
leaves ``out`` as it was (or, killed between the two renames of a replacement, absent), never partly
written. The next write deletes what a killed one left (``<out>.tmp``, ``<out>.replaced.tmp``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from moe_core.training.checkpoint_files import fsync_dir

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight formats: an export writes its own weights and never copies a reference's.
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf"})
_STAGING_SUFFIX = ".tmp"
_REPLACED_SUFFIX = ".replaced.tmp"


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``.

    Raises:
        FileNotFoundError: no file ``path``.
        ValueError: not UTF-8 JSON, or JSON other than an object (naming the file, line and column).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(value).__name__}")
    return value


def _inside(directory: Path, path: Path) -> bool:
    """Whether ``path``, symlinks followed, lies in ``directory``, or in the ``blobs/`` of the Hugging Face
    cache repository that holds ``directory`` as one of its ``snapshots/<revision>/`` (the cache's own links)."""
    root, target = directory.resolve(), path.resolve()
    cache_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    return target.is_relative_to(root) or (cache_blobs is not None and target.parent == cache_blobs)


def weight_files(directory: Path) -> dict[str, Path]:
    """``{tensor key: safetensors file}`` of the HF directory ``directory``: the ``weight_map`` of
    ``model.safetensors.index.json``, else every tensor of ``model.safetensors``.

    Raises:
        FileNotFoundError: neither file, or a file the index names does not exist.
        ValueError: an index that is not ``{"weight_map": {key: file name}}``, or an entry that leads outside
            ``directory`` (``..``, an absolute path, a symlink that leaves it), named with the entry.
    """
    index = directory / INDEX_FILE
    if not index.is_file():
        single = directory / SINGLE_FILE
        if not single.is_file():
            raise FileNotFoundError(f"path: expected {SINGLE_FILE} or {INDEX_FILE} in {directory}")
        return {key: single for key in _tensor_keys(directory, single)}
    mapping = read_json(index).get("weight_map")
    if not isinstance(mapping, dict):
        raise ValueError(f"{index}: field 'weight_map': expected an object of tensor key -> file name, got "
                         f"{mapping!r:.80}")
    out = {}
    for key, name in mapping.items():
        if not isinstance(name, str):
            raise ValueError(f"{index}: weight_map entry {key!r}: expected a file name, got {name!r:.80}")
        path = directory / name
        if not _inside(directory, path):
            raise ValueError(f"{index}: weight_map entry {key!r}: {name!r} leads outside {directory} (to "
                             f"{path.resolve()}); refusing to read it")
        if not path.is_file():
            raise FileNotFoundError(f"{index}: weight_map entry {key!r}: {path} does not exist")
        out[key] = path
    return out


def _tensor_keys(directory: Path, file: Path) -> list[str]:
    if not _inside(directory, file):
        raise ValueError(f"{file}: a symlink that leads outside {directory} (to {file.resolve()}); refusing to "
                         "read it")
    with open_safetensors(file) as f:
        return list(f.keys())


def open_safetensors(path: Path):
    """``safe_open(path)`` (a context manager) with a damaged file's error naming the file.

    Raises:
        ValueError: not a safetensors file (a bad or truncated header), naming ``path``.
    """
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from e


def non_weight_files(directory: Path) -> list[Path]:
    """The top-level files of the HF directory ``directory`` other than its config, weights and weight
    indices: tokenizer files, generation config, model card."""
    return sorted(f for f in directory.iterdir() if f.is_file() and f.name != CONFIG_FILE
                  and not f.name.endswith(".index.json") and f.suffix not in _WEIGHT_SUFFIXES)


def target_entries(out: Path) -> list[str]:
    """The names in the output directory ``out``, sorted; none when it does not exist yet.

    Raises:
        FileExistsError: ``out`` exists and is not a directory.
    """
    if not out.exists():
        return []
    if not out.is_dir():
        raise FileExistsError(f"out_dir: {out} exists and is not a directory")
    return sorted(p.name for p in out.iterdir())


def listing(names: list[str]) -> str:
    """The first few of ``names``, comma-separated, for an error message."""
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def start_staging(out: Path) -> Path:
    """A new empty ``<out>.tmp/`` beside ``out`` (its parents created), after deleting what a killed write left."""
    staging = staging_dir(out)
    for stale in (staging, out.with_name(out.name + _REPLACED_SUFFIX)):
        _remove(stale)
    staging.mkdir(parents=True)
    return staging


def staging_dir(out: Path) -> Path:
    """Where ``start_staging(out)`` builds ``out`` (for ranks that write into it without creating it)."""
    return out.with_name(out.name + _STAGING_SUFFIX)


def publish_staged(staging: Path, out: Path) -> Path:
    """Make every file under ``staging`` durable and rename it to ``out``; an existing ``out`` (the caller
    decided it may be replaced) is renamed aside first and deleted once the new one is in place."""
    for root, _, names in os.walk(staging):
        for name in names:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))
    replaced = out.with_name(out.name + _REPLACED_SUFFIX)
    if out.exists() or out.is_symlink():
        out.rename(replaced)
    staging.rename(out)
    fsync_dir(out.parent)
    _remove(replaced)
    return out


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """``start_staging(out)``, given to the block; published to ``out`` when the block completes, deleted when
    it raises."""
    staging = start_staging(out)
    try:
        yield staging
    except BaseException:
        _remove(staging)
        raise
    publish_staged(staging, out)


__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "read_json", "weight_files", "open_safetensors",
           "non_weight_files", "target_entries", "listing", "start_staging", "staging_dir", "publish_staged", "staged"]
