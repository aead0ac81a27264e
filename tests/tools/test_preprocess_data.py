"""tools/preprocess_data.py: Megatron's flags, files byte for byte megatron-core's, errors naming file and line."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from moe_core.training.indexed_dataset import IndexedDataset
from tests.training._tokenizers import build_tokenizer_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import preprocess_data  # noqa: E402

with warnings.catch_warnings():  # megatron-core warns that TransformerEngine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as megatron
    from megatron.core.tokenizers import MegatronTokenizer

LINES = [{"text": "def add(a, b):\n    return a + b\n", "title": "add"},
         {"text": "", "title": "empty text: an empty document"},
         {"text": ["The quick brown fox.", "", "It jumps over the lazy dog."], "title": "sentences"},
         {"text": "What is 12 plus 7? It is 19. \u00e9\u4e2d<|im_end|>", "title": "unicode and a special token"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def _megatron_files(prefix: Path, lines: list[dict], key: str, tokenizer_dir: Path, append_eod: bool) -> None:
    """What Megatron-LM's tools/preprocess_data.py writes: megatron-core's tokenizer and builder, its loop."""
    tokenizer = MegatronTokenizer.from_pretrained(str(tokenizer_dir), metadata_path={"library": "huggingface"})
    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", dtype=megatron.DType.optimal_dtype(tokenizer.vocab_size))
    for record in lines:
        sentences = record[key] if isinstance(record[key], list) else [record[key]]
        ids, lengths = [], []
        for sentence in sentences:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("workers, append_eod", [(1, True), (2, True), (1, False)])
def test_output_is_megatrons_byte_for_byte(tmp_path, tokenizer_dir, workers, append_eod):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in LINES * 20) + "\n")  # a blank last line is skipped
    flags = ["--input", str(source), "--json-keys", "text", "title", "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", str(tokenizer_dir), "--output-prefix", str(tmp_path / "out" / "c"),
             "--workers", str(workers)] + (["--append-eod"] if append_eod else [])
    preprocess_data.main(flags)
    for key in ("text", "title"):
        _megatron_files(tmp_path / key, LINES * 20, key, tokenizer_dir, append_eod)
        for suffix in (".bin", ".idx"):
            ours = (tmp_path / "out" / f"c_{key}_document{suffix}").read_bytes()
            assert ours == (tmp_path / f"{key}{suffix}").read_bytes(), (key, suffix)
    ds = IndexedDataset(tmp_path / "out" / "c_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == 80 and len(ds) == 20 * 4  # 1 + 0 + 2 + 1 sequences
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "c_text_document.bin", "c_text_document.idx", "c_title_document.bin", "c_title_document.idx"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "a"', r"invalid JSON \(Expecting ',' delimiter at column 13\)"),
    ('["text"]', "expected a JSON object, got list"),
    ('{"body": "a"}', r"no key 'text' \(--json-keys\); the object has \['body'\]"),
    ('{"text": 3}', "'text' must be a string or a list of strings"),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_lines_name_file_and_line_and_leave_no_files(tmp_path, tokenizer_dir, line, message, workers):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "fine"}\n\n' + line + "\n")
    flags = ["--input", str(source), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             str(tokenizer_dir / "tokenizer.json"), "--output-prefix", str(tmp_path / "c"), "--workers", str(workers)]
    with pytest.raises(ValueError, match=rf"input: {source}:3: {message}"):
        preprocess_data.preprocess(preprocess_data.parse_args(flags))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_bad_arguments_are_named(tmp_path, tokenizer_dir, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "caf\xe9"}\n')
    base = ["--tokenizer-type", "HuggingFaceTokenizer", "--output-prefix", str(tmp_path / "c")]
    with pytest.raises(SystemExit, match=rf"input: {source}:1: byte 13 of the line is not valid UTF-8"):
        preprocess_data.main(base + ["--input", str(source), "--tokenizer-model", str(tokenizer_dir)])
    with pytest.raises(SystemExit, match=r"tokenizer: .*nowhere: expected a tokenizer directory"):
        preprocess_data.main(base + ["--input", str(source), "--tokenizer-model", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"input: .*missing.jsonl: cannot read it"):
        preprocess_data.main(base + ["--input", str(tmp_path / "missing.jsonl"), "--tokenizer-model",
                                     str(tokenizer_dir)])
    with pytest.raises(SystemExit, match="workers: expected an int >= 1, got 0"):
        preprocess_data.main(base + ["--input", str(source), "--tokenizer-model", str(tokenizer_dir),
                                     "--workers", "0"])
