"""Reading DCP's ``.metadata`` without running code from it.

Where torch 2.13's torch.distributed.checkpoint unpickles (torch/distributed/checkpoint/filesystem.py and
default_planner.py):

- ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load``, and when that fails falls back
  to a rank-local ``__<rank>.metadata``, also unpickled;
- ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry (a "bytes" item) with
  ``torch.load(weights_only=False)``, which is a full unpickle;
- tensor payloads go through ``torch.load(weights_only=True)``: safe.

DCP has no pickle-free metadata format, so loading guards both places:

- checkpoints hold tensors only in DCP (the rest is in state.json), and ``read_metadata`` rejects a
  ``.metadata`` with any bytes entry, so the planner never reaches ``torch.load(weights_only=False)``;
- ``.metadata`` is unpickled by ``_MetadataUnpickler``, whose ``find_class`` admits only DCP's metadata
  classes, ``torch.Size``, torch dtypes, torch's layout lookup and ``pathlib.PosixPath``: a pickle naming any
  other global (``os.system``, ``builtins.eval``, ...) fails before anything is called;
- every storage file the metadata points at must be one of the manifest's files;
- ``VerifiedReader`` gives ``dcp.load`` the metadata checked here, so DCP never reads the file itself.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from moe_core.training.checkpoint_files import CheckpointError

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_filesystem._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_ALLOWED[("pathlib", "PosixPath")] = PosixPath


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals a DCP ``.metadata`` needs."""

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")
        return found


def read_metadata(directory: Path, files: set[str]) -> dcp_metadata.Metadata:
    """``directory``'s ``.metadata``, unpickled with the allow-list and checked (module docstring).

    ``files``: the manifest's file names; the metadata may point at these only.
    Raises:
        CheckpointError: the file names a global outside the allow-list, is no DCP ``Metadata``, has a
            non-tensor entry or points at a file outside ``files``.
    """
    path = directory / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"load: {path} is unsafe or corrupt, refusing to load it: {e}") from None
    except Exception as e:  # noqa: BLE001 - a crafted pickle can raise anything while building allowed objects
        raise CheckpointError(f"load: {path} is corrupt: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict) \
            or not isinstance(metadata.storage_meta, (dcp_metadata.StorageMeta, type(None))):
        raise CheckpointError(f"load: {path} holds {type(metadata).__name__}, not DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointError(f"load: {path}: entry {key!r} is {type(entry).__name__}; moe_core checkpoints hold "
                                  "tensors only in DCP (DCP would unpickle other entries with weights_only=False)")
    for index, info in metadata.storage_data.items():
        if not isinstance(info, dcp_filesystem._StorageInfo) or info.relative_path not in files:
            where = getattr(info, "relative_path", info)
            raise CheckpointError(f"load: {path}: {getattr(index, 'fqn', index)!r} points at {where!r}, which is "
                                  "not a file of the manifest")
    return metadata


class VerifiedReader(FileSystemReader):
    """DCP's file reader with the metadata given (checked by ``read_metadata``) instead of unpickled again."""

    def __init__(self, directory: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        self._metadata.storage_meta = self._metadata.storage_meta or dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


__all__ = ["read_metadata", "VerifiedReader"]
