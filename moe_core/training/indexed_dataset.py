"""Megatron's indexed dataset (``MMIDIDX``): token ids in ``PREFIX.bin``, their layout in ``PREFIX.idx``.

``PREFIX.bin`` holds the token ids of every sequence back to back, in one dtype, nothing else. ``PREFIX.idx``,
little-endian:

| bytes | field |
| --- | --- |
| 9 | ``b"MMIDIDX\\x00\\x00"`` |
| 8 | version, uint64: 1 |
| 1 | dtype code of the ``.bin`` (``DTYPE_CODES``) |
| 8 | sequence count n, uint64 |
| 8 | document-index count d + 1, uint64 |
| 4 n | sequence lengths (tokens), int32 |
| 8 n | sequence pointers (byte offsets into the ``.bin``), int64 |
| 8 (d + 1) | document indices, int64: document j is sequences ``[doc[j], doc[j + 1])``, from 0 to n |
| n, optional | sequence modes, int8 (Megatron's multimodal datasets) |

A document is one JSON line of ``tools/preprocess_data.py`` (one sequence per document unless the line held a
list of sentences). Both files are memory-mapped: opening a dataset reads nothing of the ``.bin``, and a read
touches only the pages of the tokens asked for, so a corpus larger than RAM trains.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from moe_core.config import require_regular_file

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """The ``.bin`` dtype for ids below ``vocab_size``: uint16 under 65500 ids, else int32 (Megatron's rule)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _dtype_code(dtype) -> int:
    for code, known in DTYPE_CODES.items():
        if np.dtype(known) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype: expected one of {sorted(np.dtype(d).name for d in DTYPE_CODES.values())}, got {dtype}")


def index_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def data_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def is_indexed_dataset(prefix: str | os.PathLike) -> bool:
    """True when both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
    return index_path(prefix).exists() and data_path(prefix).exists()


class IndexedDataset:
    """A memory-mapped ``MMIDIDX`` dataset (module docstring); Megatron's ``IndexedDataset`` without its S3 and
    multi-storage readers.

    Attributes:
        prefix: the path prefix. dtype: the ``.bin`` dtype.
        sequence_lengths: ``[n]`` int32. sequence_pointers: ``[n]`` int64 byte offsets. document_indices:
            ``[d + 1]`` int64. sequence_modes: ``[n]`` int8 or None. All read-only views of the mapped index.
        tokens: the whole ``.bin`` as a read-only ``[sum(sequence_lengths)]`` memory map.

    Raises:
        ValueError: a file is missing or not regular, the header, version or dtype code is not Megatron's, or
            the files' sizes, the pointers or the document indices do not fit together; names the file.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        idx, bin_ = index_path(prefix), data_path(prefix)
        require_regular_file("data_path", idx)
        require_regular_file("data_path", bin_)
        with open(idx, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(f"data_path: {idx}: not a Megatron index file (expected the header {INDEX_HEADER!r})")
        version, code, n, docs = struct.unpack("<QBQQ", head[len(INDEX_HEADER):])
        if version != INDEX_VERSION:
            raise ValueError(f"data_path: {idx}: index version {version}, expected {INDEX_VERSION}")
        if code not in DTYPE_CODES:
            raise ValueError(f"data_path: {idx}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        size = idx.stat().st_size
        base = _HEADER_BYTES + 12 * n + 8 * docs
        if size not in (base, base + n):
            raise ValueError(f"data_path: {idx}: {size} bytes, expected {base} for {n} sequences and {docs} document "
                             f"indices ({base + n} with sequence modes): the file is truncated or not an index")
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(index, np.int32, n, _HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(index, np.int64, n, _HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(index, np.int64, docs, _HEADER_BYTES + 12 * n)
        self.sequence_modes = np.frombuffer(index, np.int8, n, base) if size > base else None
        self.tokens = self._map_tokens(bin_)
        self._check(idx)

    def _map_tokens(self, bin_: Path) -> np.ndarray:
        size = bin_.stat().st_size
        expected = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if size != expected:
            raise ValueError(f"data_path: {bin_}: {size} bytes, expected {expected} ({self.dtype.name} tokens of the "
                             f"{len(self.sequence_lengths)} sequences in {index_path(self.prefix)})")
        if size == 0:  # numpy cannot map an empty file
            return np.empty(0, self.dtype)
        return np.memmap(bin_, dtype=self.dtype, mode="r")

    def _check(self, idx: Path) -> None:
        """Pointers are the running sum of the lengths, document indices run from 0 to n without going back."""
        lengths, doc = self.sequence_lengths, self.document_indices
        if (lengths < 0).any():
            raise ValueError(f"data_path: {idx}: a sequence length is negative")
        starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * self.dtype.itemsize
        if not np.array_equal(self.sequence_pointers, starts[:len(lengths)]):
            raise ValueError(f"data_path: {idx}: the sequence pointers are not the running sum of the lengths")
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != len(lengths) or (np.diff(doc) < 0).any():
            raise ValueError(f"data_path: {idx}: the document indices must rise from 0 to the sequence count "
                             f"{len(lengths)}")

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        """The number of sequences."""
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i``'s tokens, a read-only view of the map."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    def sequence_token_offsets(self) -> np.ndarray:
        """``[n + 1]`` int64: sequence i is ``tokens[offsets[i]:offsets[i + 1]]`` (document j spans sequences
        ``document_indices[j]`` to ``document_indices[j + 1]``)."""
        return np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])


class IndexedDatasetBuilder:
    """Writes an ``MMIDIDX`` dataset byte for byte as megatron-core's ``IndexedDatasetBuilder`` does (no modes).

    ``PREFIX.bin`` and ``PREFIX.idx`` are written under ``.tmp`` names and renamed by ``finalize``, the index
    last, so an interrupted run leaves no pair of files that reads as a dataset.

    Args:
        prefix: the output path prefix.
        dtype: the token dtype (``optimal_dtype(vocab_size)``, Megatron's choice).
    Raises:
        ValueError: ``dtype`` has no code in ``DTYPE_CODES``.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self._code = _dtype_code(dtype)
        self.dtype = np.dtype(DTYPE_CODES[self._code])
        self.prefix = os.fspath(prefix)
        self._bin_tmp = Path(f"{data_path(prefix)}.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices = [0]

    def add_document(self, ids, lengths: list[int] | None = None) -> None:
        """Append one document: ``ids`` (any integer sequence), made of sequences of ``lengths`` tokens (default:
        one sequence of all of them, none for no ids: an empty document, as Megatron writes for empty text).

        Raises:
            ValueError: ``lengths`` do not sum to the number of ids, or an id does not fit the dtype.
        """
        array = np.asarray(ids)
        if lengths is None:
            lengths = [array.size] if array.size else []
        if sum(lengths) != array.size:
            raise ValueError(f"lengths: expected them to sum to the document's {array.size} ids, got {sum(lengths)}")
        limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else np.finfo(self.dtype)
        if array.size and (array.min() < limits.min or array.max() > limits.max):
            raise ValueError(f"ids: {self.dtype.name} cannot hold the ids {array.min()}..{array.max()}")
        self._bin.write(array.astype(self.dtype).tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, *_) -> None:
        """On an error, close and delete the unfinished ``.bin``."""
        if exc_type is not None:
            self._bin.close()
            self._bin_tmp.unlink(missing_ok=True)

    def finalize(self) -> None:
        """Close the ``.bin``, write the ``.idx``, and rename both to their final names."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])[:len(lengths)] * self.dtype.itemsize
        idx_tmp = Path(f"{index_path(self.prefix)}.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(INDEX_HEADER + struct.pack("<QBQQ", INDEX_VERSION, self._code, len(lengths),
                                               len(self.document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.astype(np.int64).tobytes())
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes())
        os.replace(self._bin_tmp, data_path(self.prefix))
        os.replace(idx_tmp, index_path(self.prefix))


__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "optimal_dtype", "is_indexed_dataset", "index_path",
           "data_path", "DTYPE_CODES"]
