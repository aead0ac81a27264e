"""Megatron's MMIDIDX format: files megatron-core writes read back here, and ours are byte for byte its own."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch

from moe_core.training.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, is_indexed_dataset, optimal_dtype

with warnings.catch_warnings():  # megatron-core warns that TransformerEngine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as megatron


def _documents(seed: int, high: int) -> list[list[np.ndarray]]:
    """Documents of 0-3 sequences (sentences) of 0-40 ids in [0, high), an empty document among them."""
    rng = np.random.default_rng(seed)
    docs = [[rng.integers(0, high, rng.integers(1, 40)) for _ in range(rng.integers(1, 4))] for _ in range(30)]
    docs[7] = []
    return docs


def _write_megatron(prefix, docs, dtype) -> None:
    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sentences in docs:
        ids = np.concatenate(sentences) if sentences else np.zeros(0, np.int64)
        builder.add_document(ids.tolist(), [len(s) for s in sentences])
    builder.finalize(f"{prefix}.idx")


def _write_ours(prefix, docs, dtype) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for sentences in docs:
            ids = np.concatenate(sentences) if sentences else np.zeros(0, np.int64)
            builder.add_document(ids, [len(s) for s in sentences])
        builder.finalize()


@pytest.mark.parametrize("vocab", [300, 70_000])
def test_files_are_byte_identical_both_ways(tmp_path, vocab):
    dtype = optimal_dtype(vocab)
    assert dtype == megatron.DType.optimal_dtype(vocab)
    docs = _documents(vocab, vocab)
    _write_megatron(tmp_path / "megatron", docs, dtype)
    _write_ours(tmp_path / "ours", docs, dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"megatron{suffix}").read_bytes()
    ours, theirs = IndexedDataset(tmp_path / "megatron"), megatron.IndexedDataset(str(tmp_path / "ours"))
    assert ours.dtype == dtype and len(ours) == len(theirs) and ours.num_documents == len(docs)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(theirs)):
        np.testing.assert_array_equal(ours[i], theirs[i])
    offsets = ours.sequence_token_offsets()[ours.document_indices]
    for j, sentences in enumerate(docs):
        expected = np.concatenate(sentences) if sentences else np.zeros(0)
        np.testing.assert_array_equal(ours.tokens[offsets[j]:offsets[j + 1]], expected)


def test_reads_memory_mapped_without_loading(tmp_path):
    _write_ours(tmp_path / "d", _documents(0, 300), np.uint16)
    ds = IndexedDataset(tmp_path / "d")
    assert isinstance(ds.tokens, np.memmap) and not ds.tokens.flags.writeable
    assert is_indexed_dataset(tmp_path / "d") and not is_indexed_dataset(tmp_path / "missing")


def test_sequence_modes_are_read(tmp_path):
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32, multimodal=True)
    builder.add_item(torch.tensor([1, 2, 3]), mode=1)
    builder.add_item(torch.tensor([4]), mode=0)
    builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.sequence_modes.tolist() == [1, 0] and ds.tokens.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("damage, message", [
    (lambda idx, bin_: idx.write_bytes(b"NOTANIDX" + idx.read_bytes()[8:]), r"\.idx: not a Megatron index file"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]),
     r"\.idx: index version 2, expected 1"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x09" + idx.read_bytes()[18:]),
     r"\.idx: unknown dtype code 9"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), r"\.idx: \d+ bytes, expected \d+ .*truncated"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), r"\.bin: \d+ bytes, expected \d+ \(uint16 tokens"),
    (lambda idx, bin_: bin_.unlink(), r"\.bin: cannot read it"),
])
def test_damaged_files_are_named(tmp_path, damage, message):
    _write_ours(tmp_path / "d", _documents(1, 300), np.uint16)
    damage(tmp_path / "d.idx", tmp_path / "d.bin")
    with pytest.raises(ValueError, match=rf"data_path: .*d{message}"):
        IndexedDataset(tmp_path / "d")


def test_inconsistent_pointers_and_document_indices_are_refused(tmp_path):
    _write_ours(tmp_path / "d", [[np.arange(4)], [np.arange(3)]], np.int32)
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    pointers = 34 + 4 * 2
    raw[pointers + 8:pointers + 16] = struct.pack("<q", 4)  # the second sequence should start at byte 16
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="pointers are not the running sum"):
        IndexedDataset(tmp_path / "d")
    _write_ours(tmp_path / "e", [[np.arange(4)], [np.arange(3)]], np.int32)
    raw = bytearray((tmp_path / "e.idx").read_bytes())
    raw[-8:] = struct.pack("<q", 1)  # the last document index must be the sequence count
    (tmp_path / "e.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="document indices must rise from 0 to the sequence count 2"):
        IndexedDataset(tmp_path / "e")


def test_builder_refuses_bad_input_and_leaves_nothing_on_error(tmp_path):
    with pytest.raises(ValueError, match="dtype: expected one of"):
        IndexedDatasetBuilder(tmp_path / "x", np.complex64)
    with pytest.raises(ValueError, match="uint16 cannot hold the ids 0..70000"):
        with IndexedDatasetBuilder(tmp_path / "x", np.uint16) as builder:
            builder.add_document([0, 70_000])
    with pytest.raises(ValueError, match="lengths: expected them to sum to the document's 3 ids, got 2"):
        with IndexedDatasetBuilder(tmp_path / "y", np.uint16) as builder:
            builder.add_document([1, 2, 3], [2])
    assert list(tmp_path.iterdir()) == []
