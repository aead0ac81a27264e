"""Bad data files fail with errors naming the file and line; the encoding policy is explicit; one file splits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_core.config import TransformerConfig
from moe_core.training.config import TrainingConfig
from moe_core.training.data import VALID_PERCENT, build_token_streams, read_documents
from moe_core.training.tokenizer import ByteTokenizer, HFTokenizer
from moe_core.training.trainer import pretrain

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import pretrain_gpt  # noqa: E402


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
    with pytest.raises(ValueError, match=r"tokenizer: .*missing\.json: cannot read it \(No such file or directory\)"):
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


def test_data_path_must_be_a_regular_file(tmp_path):
    """A FIFO would block the reader until a writer comes and /dev/zero would be read until memory runs out."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"^data_path: {fifo}: expected a regular file, got a FIFO$"):
        read_documents([fifo])
    with pytest.raises(ValueError, match=r"^data_path: /dev/zero: expected a regular file, got a character device$"):
        build_token_streams(["/dev/zero"], ByteTokenizer())
    with pytest.raises(ValueError, match=rf"^data_path: {tmp_path}: expected a regular file, got a directory$"):
        read_documents([tmp_path])
    with pytest.raises(ValueError, match=r"^data_path: .*missing\.txt: cannot read it \(No such file or directory\)$"):
        read_documents([tmp_path / "missing.txt"])
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")  # a link to a regular file is one
    assert [text for _, text in read_documents([tmp_path / "link.txt"])] == ["text"]


def test_tokenizer_ids_beyond_its_token_count_size_the_vocabulary(tmp_path):
    """A vocabulary with gaps: 3 tokens, ids up to 500. vocab_size is the rows its ids need (501), so the model
    --tokenizer sizes holds every id, and a model too small for them is refused at start-up naming both sizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 500, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    assert tok.get_vocab_size() == 3 and HFTokenizer(path).vocab_size == 501
    assert pretrain_gpt.parse_args(["--tokenizer", path])[0].vocab_size == 501
    model = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=256)
    with pytest.raises(ValueError, match=r"^vocab_size: the tokenizer's ids need 501 embedding rows \(its largest id "
                                         r"is 500\), the model's vocab_size is 256$"):
        pretrain(model, TrainingConfig(tokenizer=path), log=lambda *_: None)


def test_token_stream_ids_are_checked_against_the_tokenizer(tmp_path):
    class Lying(ByteTokenizer):
        vocab_size = 100  # "z" (122) is beyond it

    path = tmp_path / "one.txt"
    path.write_text("zebra " * 50)
    with pytest.raises(ValueError, match=r"^tokenizer: the train split holds token id 122, outside the tokenizer's "
                                         r"\[0, vocab_size\) = \[0, 100\)$"):
        build_token_streams([str(path)], Lying())
