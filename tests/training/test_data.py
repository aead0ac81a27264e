"""Corpus discovery, the file-level split, batches, sharding and tokenizers."""

import json

import numpy as np
import pytest
import torch

from moe_core.training.data import build_token_streams, is_validation, sample_batch, shard_rows, stdlib_sources
from moe_core.training.tokenizer import ByteTokenizer, HFTokenizer


def test_stdlib_sources_exclude_tests_and_site_packages():
    files = stdlib_sources()
    assert len(files) > 300
    for path in files:
        parts = set(path.parts)
        assert not parts & {"site-packages", "test", "tests", "idle_test"}, path
    assert any(p.name == "json" or p.parent.name == "json" for p in files)


def test_split_is_by_file_deterministic_and_disjoint(tmp_path):
    names = [f"doc{i}.txt" for i in range(400)]
    valid = [n for n in names if is_validation(n)]
    assert valid == [n for n in names if is_validation(n)]
    assert 5 <= len(valid) <= 45
    for i, name in enumerate(names[:60]):
        (tmp_path / name).write_text(f"document {i} " * 20)
    streams = build_token_streams([str(tmp_path / n) for n in names[:60]], ByteTokenizer())
    train, valid_text = bytes(streams["train"]).decode(), bytes(streams["valid"]).decode()
    for i in range(60):
        marker = f"document {i} "
        assert (marker in train) != (marker in valid_text) or marker in train and f"document {i}0" in valid_text


def test_jsonl_and_text_inputs(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"line {i} " * 5}) for i in range(30)))
    text = tmp_path / "b.txt"
    text.write_text("plain text file " * 10)
    streams = build_token_streams([str(jsonl), str(text)], ByteTokenizer())
    joined = bytes(streams["train"]).decode() + bytes(streams["valid"]).decode()
    assert "line 7" in joined and "plain text file" in joined and '"text"' not in joined


def test_batches_are_reproducible_and_shard_disjointly():
    tokens = np.arange(10_000, dtype=np.int64) % 251
    inputs, labels = sample_batch(tokens, 8, 32, seed=1, step=5)
    again, _ = sample_batch(tokens, 8, 32, seed=1, step=5)
    other, _ = sample_batch(tokens, 8, 32, seed=1, step=6)
    assert inputs.shape == labels.shape == (8, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    shards = [shard_rows(inputs, r, 4) for r in range(4)]
    assert torch.equal(torch.cat(shards), inputs)
    with pytest.raises(ValueError, match="ranks"):
        shard_rows(inputs, 0, 3)
    with pytest.raises(ValueError, match="seq_length"):
        sample_batch(tokens[:10], 2, 32, seed=0, step=0)


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def foo(): return bar"] * 50, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = HFTokenizer(str(path))
    ids = hf.encode("def foo(): return bar")
    assert ids.dtype == np.int32 and 0 < len(ids) < len("def foo(): return bar")
    assert hf.vocab_size <= 60 and ids.max() < hf.vocab_size
