#!/usr/bin/env python3
"""Tokenize JSONL into Megatron's indexed datasets (``.bin`` / ``.idx``), as Megatron-LM's tools/preprocess_data.py.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./Qwen3-tiny --append-eod --workers 4

Each line of ``--input`` is a JSON object (blank lines are skipped). Each key of ``--json-keys`` (default
``text``) becomes the dataset ``PREFIX_KEY_document``, one document per line: the key's string, or its list of
strings (one sequence each; empty ones are dropped). ``--append-eod`` ends every non-empty document with the
tokenizer's end-of-sequence token, which document masking (``--reset-attention-mask``) needs. Token ids are
megatron-core's ``HuggingFaceTokenizer``'s (no special tokens added) and the dtype is uint16 below 65500 ids,
else int32: the files are byte for byte those of Megatron's tool on the same input and tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_core.config import require_regular_file  # noqa: E402
from moe_core.training.indexed_dataset import IndexedDatasetBuilder, optimal_dtype  # noqa: E402
from moe_core.training.tokenizer import load_pretrained_tokenizer  # noqa: E402

_worker: dict = {}  # each worker process's tokenizer and settings


def _init_worker(tokenizer_model: str, json_keys: list[str], append_eod: bool, input_name: str) -> None:
    tokenizer = load_pretrained_tokenizer(tokenizer_model)
    _worker.update(tokenizer=tokenizer, keys=json_keys, eod=tokenizer.eos_token_id if append_eod else None,
                   input=input_name)


def encode_line(numbered: tuple[int, bytes]) -> tuple[dict[str, tuple[list[int], list[int]]] | None, int]:
    """``(line number, raw line)`` -> ``({key: (ids, sequence lengths)}, bytes read)``; None for a blank line.

    Raises:
        ValueError: the line is not UTF-8, not a JSON object, lacks a key or holds something other than a string
            or a list of strings there; names the file and line.
    """
    number, raw = numbered
    where = f"input: {_worker['input']}:{number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: byte {e.start} of the line is not valid UTF-8 ({e.reason})") from None
    if not line.strip():
        return None, len(raw)
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    out = {}
    for key in _worker["keys"]:
        if key not in record:
            raise ValueError(f"{where}: no key {key!r} (--json-keys); the object has {sorted(record)}")
        text = record[key]
        sentences = text if isinstance(text, list) else [text]
        if not all(isinstance(s, str) for s in sentences):
            raise ValueError(f"{where}: {key!r} must be a string or a list of strings")
        ids, lengths = [], []
        for sentence in sentences:
            sentence_ids = _worker["tokenizer"].encode(sentence, add_special_tokens=False)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids and _worker["eod"] is not None:
            ids.append(_worker["eod"])
            lengths[-1] += 1
        out[key] = (ids, lengths)
    return out, len(raw)


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's name of the dataset of ``key``: ``PREFIX_KEY_document``."""
    return f"{prefix}_{key}_document"


def preprocess(args: argparse.Namespace) -> list[str]:
    """Write one dataset per JSON key; returns their prefixes.

    Raises:
        ValueError: ``--input`` is not a regular file, the tokenizer cannot be loaded or has no end-of-sequence
            token for ``--append-eod``, ``--workers`` is below 1, or a line is malformed (``encode_line``).
    """
    source = require_regular_file("input", args.input)
    if args.workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {args.workers}")
    tokenizer = load_pretrained_tokenizer(args.tokenizer_model)
    if args.append_eod and tokenizer.eos_token_id is None:
        raise ValueError(f"append_eod: the tokenizer {args.tokenizer_model} has no end-of-sequence token (eos_token "
                         "in tokenizer_config.json)")
    prefixes = [output_prefix(args.output_prefix, key) for key in args.json_keys]
    Path(prefixes[0]).parent.mkdir(parents=True, exist_ok=True)
    dtype = optimal_dtype(len(tokenizer))
    init = (args.tokenizer_model, args.json_keys, args.append_eod, str(source))
    pool = multiprocessing.Pool(args.workers, _init_worker, init) if args.workers > 1 else None
    with contextlib.ExitStack() as stack:  # an error deletes the unfinished files (IndexedDatasetBuilder.__exit__)
        builders = [stack.enter_context(IndexedDatasetBuilder(prefix, dtype)) for prefix in prefixes]
        if pool is not None:
            stack.callback(pool.terminate)
        lines = stack.enter_context(open(source, "rb"))
        bar = stack.enter_context(tqdm(total=source.stat().st_size, unit="B", unit_scale=True, desc="preprocess",
                                       dynamic_ncols=True, mininterval=1.0))
        if pool is None:
            _init_worker(*init)
            encoded = map(encode_line, enumerate(lines, start=1))
        else:
            encoded = pool.imap(encode_line, enumerate(lines, start=1), chunksize=32)
        for document, size in encoded:
            bar.update(size)
            if document is not None:
                for key, builder in zip(args.json_keys, builders, strict=True):
                    builder.add_document(*document[key])
        for builder in builders:
            builder.finalize()
    return prefixes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL file")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract, one dataset each")
    parser.add_argument("--tokenizer-type", required=True, choices=["HuggingFaceTokenizer"])
    parser.add_argument("--tokenizer-model", required=True,
                        help="a local Hugging Face tokenizer directory (or its tokenizer.json)")
    parser.add_argument("--append-eod", action="store_true", help="end each document with the EOS token")
    parser.add_argument("--output-prefix", required=True, help="path prefix of the outputs, without suffix")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        prefixes = preprocess(args)
    except ValueError as e:
        sys.exit(f"preprocess_data.py: {e}")
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    main()
