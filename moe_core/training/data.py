"""Pretraining data: documents -> one token stream per split -> random windows, sharded by data-parallel rank.

The default corpus is text every machine has: the ``.py`` sources of the running Python's standard library
(tests and site-packages excluded), split into train and validation by file. A corpus of one document is
split inside it: the last VALID_PERCENT % of its tokens (bytes with the byte tokenizer) are the validation
split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from moe_core.config import require_regular_file
from moe_core.training.batch import Batch, DocumentMasking

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
VALID_PERCENT = 5


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without test packages and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts[:-1]
        if not any(p in _EXCLUDED_DIRS or p.startswith("test") for p in parts):
            files.append(path)
    return sorted(files)


def is_validation(name: str) -> bool:
    """Deterministic file-level split: about VALID_PERCENT % of names go to validation."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 100 < VALID_PERCENT


def read_text(path: Path, encoding: str = "utf-8", errors: str = "strict") -> str:
    """The file decoded with ``bytes.decode(encoding, errors)``.

    Raises:
        ValueError: ``path`` is missing or not a regular file (a FIFO would block, ``/dev/zero`` never ends), or,
            under ``errors="strict"``, a byte does not decode; names the file (and the line and byte).
    """
    data = require_regular_file("data_path", path).read_bytes()
    try:
        return data.decode(encoding, errors)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"data_path: {path}:{line}: byte {e.start} ({data[e.start:e.start + 1]!r}) is not valid {encoding} "
            f"({e.reason}); pass --data-encoding with the files' codec, or {encoding}:replace to replace "
            "undecodable bytes with U+FFFD"
        ) from None


def read_documents(paths: list[Path], encoding: str = "utf-8", errors: str = "strict") -> list[tuple[str, str]]:
    """``(name, text)`` per document: a text file is one document, a ``.jsonl`` file one per line (its
    ``"text"`` field). ``name`` is the file's path relative to the files' common parent directory (``:line``
    appended for JSONL), so the split does not change when the corpus moves. Files are decoded by ``read_text``.

    Raises:
        ValueError: a byte does not decode (strict ``errors``), or a JSONL line is not JSON or not an object
            with a string ``"text"`` field; the message names the file and line.
    """
    # Absolute, not resolved: a symlinked file (Debian links some stdlib modules into /etc) keeps its name.
    absolute = [Path(os.path.abspath(p)) for p in paths]
    root = Path(os.path.commonpath([p.parent for p in absolute])) if absolute else Path()
    docs = []
    for path in absolute:
        name = path.relative_to(root).as_posix()
        text = read_text(path, encoding, errors)
        if path.suffix != ".jsonl":
            docs.append((name, text))
            continue
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data_path: {path}:{i}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"data_path: {path}:{i}: expected a JSON object with a string 'text' field")
            docs.append((f"{name}:{i}", record["text"]))
    return docs


def build_token_streams(data_path: list[str] | None, tokenizer, encoding: str = "utf-8",
                        errors: str = "strict") -> dict[str, np.ndarray]:
    """``{"train": tokens, "valid": tokens}``, each the split's documents encoded and concatenated; one
    document is split by tokens (module docstring). ``encoding`` / ``errors``: see ``read_text``.

    Raises:
        ValueError: no documents, a document too short to split, a ``read_documents`` error, or a token id outside
            ``[0, tokenizer.vocab_size)``.
    """
    paths = stdlib_sources() if data_path is None else [Path(p) for p in data_path]
    docs = read_documents(paths, encoding, errors)
    if len(docs) == 1:
        tokens = tokenizer.encode(docs[0][1])
        cut = len(tokens) * (100 - VALID_PERCENT) // 100
        if cut == 0 or cut == len(tokens):
            raise ValueError(f"data_path: {docs[0][0]} has {len(tokens)} tokens, too few to split into train and "
                             "validation")
        return _check_ids({"train": tokens[:cut], "valid": tokens[cut:]}, tokenizer.vocab_size)
    splits: dict[str, list[str]] = {"train": [], "valid": []}
    for name, text in docs:
        splits["valid" if is_validation(name) else "train"].append(text)
    if len(docs) >= 2 and not splits["valid"]:
        splits["valid"].append(splits["train"].pop())  # keep a validation file even for tiny corpora
    out = {}
    for split, texts in splits.items():
        if not texts:
            raise ValueError(f"data_path: the {split} split is empty ({len(docs)} documents in all)")
        out[split] = tokenizer.encode("\n".join(texts))
    return _check_ids(out, tokenizer.vocab_size)


def _check_ids(streams: dict[str, np.ndarray], vocab_size: int) -> dict[str, np.ndarray]:
    """``streams`` once every id is checked to lie in ``[0, vocab_size)``, the rows of the model's embedding."""
    for split, tokens in streams.items():
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
            bad = tokens.max() if tokens.max() >= vocab_size else tokens.min()
            raise ValueError(f"tokenizer: the {split} split holds token id {bad}, outside the tokenizer's "
                             f"[0, vocab_size) = [0, {vocab_size})")
    return streams


class TokenWindows:
    """Random windows of ``seq_length + 1`` tokens from one or more token arrays (in RAM or memory-mapped), each
    window's array drawn by weight: the batches of a step are a function of ``(seed, step)`` alone, so any rank
    layout and any resume point sees the same global batch, and each rank reads only its own rows.

    Args:
        arrays: 1-D integer token arrays, each at least ``seq_length + 1`` long.
        seq_length: S.
        weights: the probability of each array (normalised), None: one array, or arrays in proportion to their
            windows (``len - seq_length``), as one concatenated corpus.
        names: each array's name for errors (``data_path`` entries).
        vocab_size: ids are checked to lie in ``[0, vocab_size)`` as they are read (None: not checked).
        masking: end-of-document masking applied to each batch (``batch.DocumentMasking``), or None.
    Raises:
        ValueError: an array is shorter than one window, or the weights are negative or sum to 0.
    """

    def __init__(self, arrays: list[np.ndarray], seq_length: int, weights: list[float] | None = None,
                 names: list[str] | None = None, vocab_size: int | None = None,
                 masking: DocumentMasking | None = None):
        self.names = names or [f"tokens[{i}]" for i in range(len(arrays))]
        for name, array in zip(self.names, arrays, strict=True):
            if len(array) < seq_length + 1:
                raise ValueError(f"{name}: need at least seq_length + 1 = {seq_length + 1} tokens, got {len(array)}")
        windows = np.array([len(a) - seq_length for a in arrays], dtype=np.float64)
        weights = np.asarray(windows if weights is None else weights, dtype=np.float64)
        if (weights < 0).any() or not weights.sum() > 0:
            raise ValueError(f"weights: expected non-negative weights with a positive sum, got {weights.tolist()}")
        self.arrays, self.seq_length, self.weights = arrays, seq_length, weights / weights.sum()
        self.vocab_size, self.masking = vocab_size, masking
        self.num_tokens = sum(len(a) for a in arrays)

    def batch(self, batch_size: int, seed: int, step: int, rank: int = 0, world: int = 1) -> Batch:
        """Rank ``rank``'s rows (``shard_rows``) of the global batch of ``step``: ``batch_size`` windows, as
        ``input_ids`` / ``labels`` ``[batch_size / world, S]`` int64 (``labels`` the inputs shifted by one).

        Raises:
            ValueError: ``batch_size`` does not divide by ``world``, or an id read is outside ``[0, vocab_size)``
                (naming the array and the id's offset in it).
        """
        rng = np.random.default_rng([seed, step])
        which = np.zeros(batch_size, dtype=np.int64)
        if len(self.arrays) > 1:
            which = rng.choice(len(self.arrays), size=batch_size, p=self.weights)
        highs = np.array([len(a) - self.seq_length for a in self.arrays])[which]
        starts = rng.integers(0, highs, size=batch_size)  # windows of seq_length + 1 tokens
        mine = shard_rows(np.arange(batch_size), rank, world)
        windows = np.stack([self._read(which[r], starts[r]) for r in mine]) if len(mine) else np.zeros(
            (0, self.seq_length + 1), dtype=np.int64)
        windows = torch.from_numpy(windows)
        inputs, labels = windows[:, :-1], windows[:, 1:]
        return Batch(inputs, labels) if self.masking is None else self.masking(inputs, labels)

    def _read(self, index: int, start: int) -> np.ndarray:
        window = np.asarray(self.arrays[index][start:start + self.seq_length + 1]).astype(np.int64)
        if self.vocab_size is not None:
            bad = (window < 0) | (window >= self.vocab_size)
            if bad.any():
                offset = start + int(np.argmax(bad))
                raise ValueError(f"{self.names[index]}: token id {window[bad][0]} at token {offset} is outside the "
                                 f"model's [0, vocab_size) = [0, {self.vocab_size})")
        return window


def sample_batch(tokens: np.ndarray, batch_size: int, seq_length: int, seed: int, step: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``batch_size`` random windows, ``(input_ids, labels)`` ``[B, S]`` int64
    (``TokenWindows`` of one array).

    Raises:
        ValueError: the stream is shorter than one window.
    """
    inputs, labels, _, _ = TokenWindows([tokens], seq_length, names=["tokens"]).batch(batch_size, seed, step)
    return inputs, labels


def shard_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of ``batch``'s rows (``B`` must divide by ``world_size``).

    Raises:
        ValueError: the rows don't divide evenly.
    """
    if batch.shape[0] % world_size:
        raise ValueError(f"batch: {batch.shape[0]} rows don't split over {world_size} ranks")
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


__all__ = ["stdlib_sources", "is_validation", "read_text", "read_documents", "build_token_streams", "TokenWindows",
           "sample_batch", "shard_rows"]
