"""Megatron's ``--data-path`` blends and ``--split`` over indexed datasets (``indexed_dataset.py``).

A blend is ``[weight, prefix, weight, prefix, ...]`` (Megatron's ``--data-path 0.3 a 0.7 b``) or ``[prefix, ...]``
(each prefix in proportion to its tokens, as one concatenated corpus). ``--split 969,30,1`` cuts every prefix's
sequences (its documents, one sequence each as ``tools/preprocess_data.py`` writes them) into train, validation
and test ranges in file order, at megatron-core's boundaries; each split of the blend is a ``data.TokenWindows``
over the memory-mapped tokens of those sequences, with the blend's weights.
"""

from __future__ import annotations

import re

import numpy as np

from moe_core.training.batch import DocumentMasking
from moe_core.training.data import TokenWindows
from moe_core.training.indexed_dataset import IndexedDataset, is_indexed_dataset

SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"  # Megatron's default


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``(prefixes, weights)`` of a ``--data-path`` list; weights None when none are given.

    Raises:
        ValueError: weights and prefixes do not alternate, or a weight is negative or not finite.
    """
    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    if number(data_path[0]) is None:
        return list(data_path), None
    weights, prefixes = data_path[0::2], data_path[1::2]
    values = [number(w) for w in weights]
    if len(weights) != len(prefixes) or any(v is None for v in values) or any(number(p) is not None
                                                                               for p in prefixes):
        raise ValueError(f"data_path: expected weight and prefix pairs ('0.3 a 0.7 b') or prefixes only, got "
                         f"{data_path}")
    if not all(np.isfinite(v) and v >= 0 for v in values) or not sum(values) > 0:
        raise ValueError(f"data_path: weights must be finite, non-negative and not all 0, got {weights}")
    return list(prefixes), values


def parse_split(split: str) -> list[float]:
    """Megatron's ``--split`` (``"969,30,1"``, ``"98,2"``: train, validation, test weights; missing ones 0) as
    three fractions summing to 1.

    Raises:
        ValueError: not one to three non-negative numbers with a positive sum.
    """
    parts = re.split(r"[,/]", split)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not np.isfinite(v) or v < 0 for v in values) or not sum(values) > 0:
        raise ValueError(f"split: expected one to three non-negative numbers with a positive sum, as "
                         f"'{DEFAULT_SPLIT}' (train, validation, test), got {split!r}")
    values = np.asarray(values + [0.0] * (3 - len(values)), dtype=np.float64)
    return (values / values.sum()).tolist()


def split_indices(fractions: list[float], count: int) -> list[int]:
    """megatron-core's boundaries ``[0, a, b, count]`` of the three splits of ``count`` sequences: each cumulative
    fraction times ``count``, rounded."""
    cumulative = [0.0]
    for fraction in fractions:
        cumulative.append(cumulative[-1] + fraction)
    return [int(round(c * float(count))) for c in cumulative]


def build_blend(data_path: list[str], split: str | None, seq_length: int, vocab_size: int,
                masking: DocumentMasking | None) -> dict[str, TokenWindows]:
    """``{"train": windows, "valid": windows}`` over the blend's memory-mapped splits.

    Raises:
        ValueError: a prefix is not an indexed dataset (``PREFIX.bin`` and ``PREFIX.idx``), holds other than
            integer tokens, or has a train or validation split shorter than one window;
            ``parse_blend`` / ``parse_split`` errors.
    """
    prefixes, weights = parse_blend(data_path)
    fractions = parse_split(split or DEFAULT_SPLIT)
    datasets = []
    for prefix in prefixes:
        if not is_indexed_dataset(prefix):
            raise ValueError(f"data_path: {prefix}: expected an indexed dataset, {prefix}.bin and {prefix}.idx "
                             "(tools/preprocess_data.py writes them)")
        dataset = IndexedDataset(prefix)
        if dataset.dtype.kind not in "iu":
            raise ValueError(f"data_path: {prefix}: holds {dataset.dtype.name} values, expected integer token ids")
        datasets.append(dataset)
    out = {}
    for i, name in enumerate(SPLITS[:2]):
        arrays = []
        for prefix, dataset in zip(prefixes, datasets, strict=True):
            bounds = split_indices(fractions, len(dataset))
            offsets = dataset.sequence_token_offsets()
            tokens = dataset.tokens[offsets[bounds[i]]:offsets[bounds[i + 1]]]
            if len(tokens) < seq_length + 1:
                raise ValueError(f"data_path: {prefix}: the {name} split (sequences {bounds[i]}..{bounds[i + 1]} of "
                                 f"{len(dataset)}, split {split or DEFAULT_SPLIT}) holds {len(tokens)} tokens, fewer "
                                 f"than one window of seq_length + 1 = {seq_length + 1}")
            arrays.append(tokens)
        out[name] = TokenWindows(arrays, seq_length, weights, names=[f"data_path: {p}" for p in prefixes],
                                 vocab_size=vocab_size, masking=masking)
    return out


__all__ = ["parse_blend", "parse_split", "split_indices", "build_blend", "DEFAULT_SPLIT"]
