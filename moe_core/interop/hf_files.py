"""The files of a Hugging Face directory: JSON read with errors that name the file, and the weight files a
directory's index names (never outside it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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


__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "read_json", "weight_files", "open_safetensors"]
