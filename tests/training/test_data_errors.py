"""Bad data files fail with errors naming the file and line; the encoding policy is explicit; one file splits."""

from __future__ import annotations

import numpy as np
import pytest

from moe_core.training.config import TrainingConfig
from moe_core.training.data import VALID_PERCENT, build_token_streams, read_documents
from moe_core.training.tokenizer import ByteTokenizer, HFTokenizer


def test_invalid_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(ValueError, match=rf"data_path: {path}:3: invalid JSON \(.* at column 13\)"):
        read_documents([path])


def test_tokenizer_json_errors_name_the_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0",\n "model": {\n  "type": "BPE", oops\n}}')
    with pytest.raises(ValueError, match=rf"tokenizer: {path}: not a loadable .* at line 3 column \d+"):
        HFTokenizer(str(path))
    with pytest.raises(ValueError, match=r"tokenizer: .*missing\.json: not a loadable"):
        HFTokenizer(str(tmp_path / "missing.json"))


def test_non_utf8_data_is_an_error_by_default(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("line one\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"data_path: {path}:2: byte 12 \(b'\\xe9'\) is not valid utf-8"):
        read_documents([path])
    codec, errors = TrainingConfig(data_encoding="utf-8:replace").decode_args()
    assert read_documents([path], codec, errors)[0][1] == "line one\ncaf\ufffd\n"
    codec, errors = TrainingConfig(data_encoding="latin-1").decode_args()
    assert read_documents([path], codec, errors)[0][1] == "line one\ncaf\u00e9\n"


@pytest.mark.parametrize("value, message", [("utf-9", "unknown codec 'utf-9'"),
                                            ("utf-8:surrogateescape", "errors one of")])
def test_data_encoding_is_checked(value, message):
    with pytest.raises(ValueError, match=f"data_encoding: .*{message}"):
        TrainingConfig(data_encoding=value)


def test_a_single_file_corpus_splits_by_bytes(tmp_path):
    path = tmp_path / "one.txt"
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    path.write_text(text)
    streams = build_token_streams([str(path)], ByteTokenizer())
    cut = 1000 * (100 - VALID_PERCENT) // 100
    assert np.array_equal(streams["train"], np.frombuffer(text[:cut].encode(), dtype=np.uint8))
    assert np.array_equal(streams["valid"], np.frombuffer(text[cut:].encode(), dtype=np.uint8))
    (tmp_path / "tiny.txt").write_text("a")
    with pytest.raises(ValueError, match="tiny.txt has 1 tokens, too few to split"):
        build_token_streams([str(tmp_path / "tiny.txt")], ByteTokenizer())
