"""Blends and splits of indexed datasets, windows read per rank, and EOD masks as Megatron makes them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from moe_core.models.document_mask import document_causal_mask
from moe_core.training.batch import IGNORE_INDEX, DocumentMasking
from moe_core.training.blend import build_blend, parse_blend, parse_split, split_indices
from moe_core.training.data import TokenWindows
from moe_core.training.indexed_dataset import IndexedDatasetBuilder

with warnings.catch_warnings():  # megatron-core warns that TransformerEngine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    from megatron.core.datasets.utils import get_blend_from_list

SEQ = 16


def _write(prefix, base: int, documents: int, length: int = 40) -> None:
    """Documents of ``length`` ids ``base + 1000 * document + position``: an id tells where it was read."""
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for d in range(documents):
            builder.add_document(base + 1000 * d + np.arange(length))
        builder.finalize()


@pytest.mark.parametrize("data_path", [["a"], ["a", "b"], ["0.3", "a", "0.7", "b"], ["30", "a", "70", "b", "1", "c"]])
def test_blend_is_parsed_as_megatron_does(data_path):
    assert parse_blend(data_path) == get_blend_from_list(data_path)


@pytest.mark.parametrize("data_path", [["0.3", "a", "b"], ["0.3", "a", "0.7"], ["0.3", "0.7"], ["-1", "a", "2", "b"],
                                       ["0", "a", "0", "b"], ["nan", "a"]])
def test_bad_blends_are_named(data_path):
    with pytest.raises(ValueError, match="data_path: "):
        parse_blend(data_path)


@pytest.mark.parametrize("split", ["969,30,1", "98,2", "100", "1,1,1", "0.5, 0.25, 0.25", "90/10/0"])
@pytest.mark.parametrize("count", [0, 1, 7, 100, 1003, 123_457])
def test_split_boundaries_are_megatron_cores(split, count):
    fractions = parse_split(split)
    assert fractions == parse_and_normalize_split(split)
    bounds = split_indices(fractions, count)
    for i, bookend in enumerate(convert_split_vector_to_split_matrix(fractions)):
        if bookend is not None:  # megatron-core's rounding of each split's ends
            assert bounds[i:i + 2] == [int(round(end * float(count))) for end in bookend]
    assert bounds[0] == 0 and bounds[-1] == count


@pytest.mark.parametrize("split", ["", "1,2,3,4", "a,b", "0,0,0", "-1,2"])
def test_bad_splits_are_named(split):
    with pytest.raises(ValueError, match="split: expected one to three non-negative numbers"):
        parse_split(split)


def test_blend_draws_by_weight_from_each_split(tmp_path):
    _write(tmp_path / "a", 0, 100)
    _write(tmp_path / "b", 500_000, 100)
    data = build_blend(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")], "80,20,0", SEQ, 10**6, None)
    counts = {"train": [0, 0], "valid": [0, 0]}
    for split, windows in data.items():
        for step in range(100):
            inputs, labels, position_ids, document_ids = windows.batch(40, seed=1, step=step)
            assert position_ids is None and document_ids is None
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            for row in torch.cat([inputs, labels[:, -1:]], dim=1):
                source = int(row[0] >= 500_000)
                documents = ((row - 500_000 * source) // 1000).unique()
                assert ((documents < 80) if split == "train" else (documents >= 80)).all(), (split, row)
                counts[split][source] += 1
    for a, b in counts.values():  # 4000 windows each: the share of a within 4 standard deviations of 0.3
        assert abs(a / (a + b) - 0.3) < 4 * (0.3 * 0.7 / 4000) ** 0.5
    # Without weights each prefix counts in proportion to its tokens: as one concatenated corpus.
    _write(tmp_path / "c", 500_000, 300)
    even = build_blend([str(tmp_path / "a"), str(tmp_path / "c")], "80,20,0", SEQ, 10**6, None)["train"]
    assert even.weights.tolist() == pytest.approx([(80 * 40 - SEQ) / (320 * 40 - 2 * SEQ),
                                                   (240 * 40 - SEQ) / (320 * 40 - 2 * SEQ)])


class _Recording:
    """A token array that records the windows read from it."""

    def __init__(self, array: np.ndarray):
        self.array, self.reads = array, []

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, window: slice) -> np.ndarray:
        self.reads.append(window.start)
        return self.array[window]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_reads_only_its_windows(world):
    arrays = [_Recording(np.arange(10_000)), _Recording(np.arange(10_000, 15_000))]
    windows = TokenWindows(arrays, SEQ, weights=[0.5, 0.5])
    whole = windows.batch(8, seed=3, step=7)
    whole_reads = [list(a.reads) for a in arrays]
    shards = []
    for rank in range(world):
        for a in arrays:
            a.reads.clear()
        shards.append(windows.batch(8, seed=3, step=7, rank=rank, world=world))
        assert sum(len(a.reads) for a in arrays) == 8 // world  # one read per row of this rank
    for field in range(2):
        assert torch.equal(torch.cat([s[field] for s in shards]), whole[field])
    assert sum(len(r) for r in whole_reads) == 8


def test_one_array_draws_the_windows_of_the_default_run():
    """One array: the starts ``rng.integers(0, n - S, size=B)`` of the seed and step, as every run so far drew."""
    tokens = np.arange(5_000)
    inputs = TokenWindows([tokens], SEQ).batch(6, seed=11, step=4).input_ids
    starts = np.random.default_rng([11, 4]).integers(0, len(tokens) - SEQ, size=6)
    assert inputs[:, 0].tolist() == starts.tolist()


def test_ids_outside_the_vocabulary_name_the_prefix(tmp_path):
    _write(tmp_path / "a", 0, 20)
    data = build_blend([str(tmp_path / "a")], "1,1", SEQ, 5_000, None)
    with pytest.raises(ValueError, match=rf"data_path: {tmp_path / 'a'}: token id \d+ at token \d+ is outside the "
                                         r"model's \[0, vocab_size\) = \[0, 5000\)"):
        for step in range(20):
            data["train"].batch(4, seed=0, step=step)


def test_blend_errors_name_the_prefix(tmp_path):
    _write(tmp_path / "a", 0, 20)
    with pytest.raises(ValueError, match=rf"data_path: {tmp_path / 'missing'}: expected an indexed dataset"):
        build_blend([str(tmp_path / "a"), str(tmp_path / "missing")], None, SEQ, 10**6, None)
    with pytest.raises(ValueError, match=rf"data_path: {tmp_path / 'a'}: the valid split \(sequences 20..20 of 20, "
                                         r"split 100,0,0\) holds 0 tokens"):
        build_blend([str(tmp_path / "a")], "100,0,0", SEQ, 10**6, None)
    with IndexedDatasetBuilder(tmp_path / "f", np.float32) as builder:
        builder.add_document(np.zeros(100))
        builder.finalize()
    with pytest.raises(ValueError, match="holds float32 values, expected integer token ids"):
        build_blend([str(tmp_path / "f")], None, SEQ, 10**6, None)


@pytest.mark.parametrize("flags", [dict(reset_position_ids=True), dict(reset_attention_mask=True),
                                   dict(eod_mask_loss=True),
                                   dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)])
def test_document_masks_are_megatrons(flags):
    eod = 7
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 10, (5, 32), generator=gen)  # about one EOD in ten, at the edges too
    inputs[0, 0], inputs[1, -1], inputs[2, :3] = eod, eod, eod
    labels = torch.randint(0, 10, (5, 32), generator=gen)
    batch = DocumentMasking(eod, **flags)(inputs, labels)
    for b in range(5):
        attention, loss_mask, positions = _get_ltor_masks_and_position_ids(
            inputs[b], eod, flags.get("reset_position_ids", False), flags.get("reset_attention_mask", False),
            flags.get("eod_mask_loss", False), create_attention_mask=True)
        assert torch.equal(batch.labels[b] != IGNORE_INDEX, loss_mask.bool())
        assert torch.equal(batch.labels[b][loss_mask.bool()], labels[b][loss_mask.bool()])
        if flags.get("reset_position_ids"):
            assert torch.equal(batch.position_ids[b], positions)
        if flags.get("reset_attention_mask"):  # Megatron's mask is True where attention is masked
            allowed = document_causal_mask(batch.document_ids[b:b + 1], flex=False)[0, 0]
            assert torch.equal(allowed, ~attention[0])
    assert (batch.position_ids is None) != bool(flags.get("reset_position_ids"))
    assert (batch.document_ids is None) != bool(flags.get("reset_attention_mask"))
