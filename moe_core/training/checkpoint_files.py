"""The files of a checkpoint directory: step_<N>/ layout, atomic publication, ``latest``, rotation, manifest.

    save/
        latest                 "step_<N>": the newest complete checkpoint, replaced by a rename
        step_<N>/              one complete checkpoint
            .metadata          DCP's index of the tensors (a pickle, read by checkpoint_metadata)
            __<r>_0.distcp     DCP's tensor data, one file per rank
            state.json         the non-tensor state (step, seed, schedule, AdamW's hyper-parameters, config)
            manifest.json      size and SHA-256 of every other file, written last
        step_<N>.tmp           a checkpoint being written, or left by a crash: never loaded, deleted by the
                               next save (whatever it is: a ``.tmp`` name is the saver's)

Publication: everything is written and fsynced in step_<N>.tmp/ (manifest last), the directory is renamed
to step_<N>/ and ``latest`` is replaced through a rename of its own, each rename followed by an fsync of the
parent directory. A process killed at any point leaves the previous checkpoint and ``latest`` intact. The
manifest detects corruption (a truncated or changed file); it is no signature: whoever can write the files
can rewrite it too, so loading never trusts the files' contents to be benign (checkpoint_metadata).

A save never deletes what it did not write: a ``step_<N>`` that is not a complete checkpoint (a file, a
directory without manifest) or a ``latest`` that is not a file stops it before anything is written. A write
that fails raises an ``OSError`` naming its file, with its errno (ENOSPC: the disk is full).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

MANIFEST = "manifest.json"
STATE = "state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP_SUFFIX = ".tmp"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded: missing, incomplete, corrupt, unsafe or of another architecture."""


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(error: BaseException | None) -> OSError | None:
    """The first ``OSError`` of ``error``'s chain (itself, then its cause or context, ...): torch's writer
    reports a failed write as a RuntimeError from inline_container.cc whose context is the OSError."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Re-raise an error caused by an ``OSError`` while writing ``path`` as an ``OSError`` with its errno and
    ``path`` as the file name (a failed write or fsync names no file; torch's writer hides the OSError)."""
    try:
        yield
    except Exception as e:
        found = _os_error(e)
        if found is None or (found is e and found.filename is not None):
            raise
        raise OSError(found.errno, found.strerror or str(found), str(path)) from e


class _NamingFileSystem(FileSystem):
    """DCP's file system with every stream's failure re-raised by ``writing``, naming its file."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        with writing(Path(path)), super().create_stream(path, mode) as stream:
            yield stream


def dcp_writer(directory: Path) -> FileSystemWriter:
    """DCP's writer into ``directory``, fsyncing its files and naming the file of a failed write."""
    writer = FileSystemWriter(directory, sync_files=True)
    writer.fs = _NamingFileSystem()
    return writer


def save_error(checkpoint: Path, error: BaseException) -> OSError | None:
    """What a save of ``checkpoint`` (``save_dir/step_<N>``) that failed with ``error`` raises: an ``OSError``
    naming the checkpoint and the file (``writing``), saying when the disk is full (ENOSPC, EDQUOT); None
    when no OSError caused ``error``. ``error`` may be DCP's ``CheckpointException``: the lowest failed
    rank's error counts."""
    if isinstance(error, CheckpointException):
        error = error.failures[min(error.failures)][0]
    found = _os_error(error)
    if found is None:
        return None
    full = "the disk is full: " if found.errno in _DISK_FULL else ""
    return OSError(found.errno, f"save: the checkpoint {checkpoint} was not written: {full}{found}; "
                                f"{checkpoint.parent / LATEST} still names the previous one")


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory entry is made durable by the caller).

    Raises:
        OSError: naming ``path`` (``writing``).
    """
    with writing(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def digest_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": hex}}`` of the files ``names`` in ``directory``."""
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
            for name in names}


def check_files(directory: Path, expected: dict[str, dict]) -> list[str]:
    """One message per file of ``expected`` (``digest_files``'s form) that is missing or differs."""
    problems = []
    for name, want in expected.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif sha256_file(path) != want["sha256"]:
            problems.append(f"{path} does not match its SHA-256 in the manifest (the file changed after the save)")
    return problems


def read_manifest(directory: Path) -> dict[str, dict]:
    """The manifest's ``{name: {"bytes", "sha256"}}``.

    Raises:
        CheckpointError: no manifest (not a complete checkpoint) or one that is not a manifest.
    """
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"load: {directory} has no {MANIFEST}: not a complete checkpoint")
    try:
        files = json.loads(path.read_text())["files"]
        ok = isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            and "/" not in k and k not in (".", "..") for k, v in files.items())
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"load: {path} is corrupt (expected JSON {{'files': {{name: {{bytes, sha256}}}}}})")
    for required in (".metadata", STATE):
        if required not in files:
            raise CheckpointError(f"load: {path} does not list {required}")
    return files


def _remove(path: Path) -> None:
    """Delete ``path``: a directory tree, or a file or symbolic link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _check_no_foreign_entries(save_dir: Path) -> None:
    """Raise ``ValueError`` naming each ``step_<N>`` in ``save_dir`` that is no complete checkpoint and a
    ``latest`` that is no file: a save would replace or delete them, and they are not the saver's."""
    foreign = []
    for path in sorted(save_dir.iterdir()) if save_dir.is_dir() else ():
        if _STEP_DIR.fullmatch(path.name) and not (path / MANIFEST).is_file():
            foreign.append(f"{path} ({'a directory without ' + MANIFEST if path.is_dir() else 'not a directory'})")
        elif path.name == LATEST and not path.is_file():
            foreign.append(f"{path} (not a file)")
    if foreign:
        raise ValueError(f"save: {save_dir} holds what save_checkpoint did not write under a name it writes: "
                         f"{', '.join(foreign)}; a save would replace it: move it away or save elsewhere")


def prepare_step_dir(save_dir: str | os.PathLike, step: int) -> Path:
    """Create ``save_dir`` and an empty ``step_<step>.tmp/`` in it, deleting what earlier crashes left there.

    Raises:
        ValueError: ``save_dir`` holds an entry the save would replace that is not the saver's
            (``_check_no_foreign_entries``).
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    _check_no_foreign_entries(save_dir)
    for stale in save_dir.glob(f"step_*{_TMP_SUFFIX}"):
        _remove(stale)
    tmp = save_dir / (step_dir_name(step) + _TMP_SUFFIX)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, keep: int) -> Path:
    """Rename the written ``step_<N>.tmp/`` to ``step_<N>/``, point ``latest`` at it, keep the ``keep``
    complete checkpoints of the highest steps (this one always) and delete the others. Returns the new path."""
    save_dir = tmp.parent
    final = save_dir / tmp.name[:-len(_TMP_SUFFIX)]
    fsync_dir(tmp)
    if final.exists():  # the same step saved again (a rerun): move the old one out of the way first
        final.rename(save_dir / (final.name + ".replaced" + _TMP_SUFFIX))
    tmp.rename(final)
    fsync_dir(save_dir)
    write_durably(save_dir / (LATEST + _TMP_SUFFIX), (final.name + "\n").encode())
    os.replace(save_dir / (LATEST + _TMP_SUFFIX), save_dir / LATEST)
    fsync_dir(save_dir)
    others = [path for step, path in sorted(complete_checkpoints(save_dir).items(), reverse=True) if path != final]
    for old in others[max(keep - 1, 0):]:
        # Renamed first, so a crash mid-deletion leaves a .tmp directory, never a half-deleted checkpoint.
        doomed = save_dir / (old.name + ".deleted" + _TMP_SUFFIX)
        old.rename(doomed)
        _remove(doomed)
    for leftover in save_dir.glob(f"step_*{_TMP_SUFFIX}"):
        _remove(leftover)
    return final


def complete_checkpoints(save_dir: Path) -> dict[int, Path]:
    """``{step: path}`` of the ``step_<N>/`` directories in ``save_dir`` that hold a manifest."""
    found = {}
    for path in save_dir.iterdir() if save_dir.is_dir() else ():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / MANIFEST).is_file():
            found[int(match[1])] = path
    return found


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, str | None]:
    """The checkpoint directory ``path`` names and a note when ``latest`` could not be followed.

    ``path`` is a checkpoint (holds a manifest) or a save directory: then the one ``latest`` names, or the
    complete one of the highest step when ``latest`` is missing or names no complete checkpoint.

    Raises:
        CheckpointError: ``path`` holds no complete checkpoint.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path, None
    found = complete_checkpoints(path)
    note = None
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        match = _STEP_DIR.fullmatch(name)
        if match and int(match[1]) in found:
            return found[int(match[1])], None
        note = f"{latest} names {name!r}, which is no complete checkpoint"
    if not found:
        raise CheckpointError(f"load: no complete checkpoint in {path} (expected {path}/step_<N>/ with a {MANIFEST}, "
                              "as save_checkpoint writes)")
    newest = found[max(found)]
    return newest, None if note is None else f"{note}; loading {newest.name}, the newest complete one"


def check_writable(save_dir: str | os.PathLike) -> None:
    """Create ``save_dir``, write a probe file in it and check it holds nothing a save would replace that is not
    the saver's (``_check_no_foreign_entries``).

    Raises:
        ValueError: the directory cannot be created or written (naming it and the OS error), or holds such an
            entry (naming it).
    """
    try:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save_dir, prefix=".write_probe"):
            pass
    except OSError as e:
        raise ValueError(f"save: cannot write checkpoints to {save_dir}: {e}") from None
    _check_no_foreign_entries(Path(save_dir))


__all__ = ["CheckpointError", "MANIFEST", "STATE", "LATEST", "check_files", "check_writable", "complete_checkpoints",
           "dcp_writer", "digest_files", "prepare_step_dir", "publish", "read_manifest", "resolve_checkpoint",
           "save_error", "write_durably", "writing"]
