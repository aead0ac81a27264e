"""Corpus discovery, the file-level split, batches, sharding and tokenizers."""

import json
import shutil
import sysconfig

import numpy as np
import pytest
import torch

from moe_core.training import data
from moe_core.training.data import (
    build_token_streams,
    is_validation,
    read_documents,
    sample_batch,
    shard_rows,
    stdlib_sources,
)
from moe_core.training.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer


def test_stdlib_sources_exclude_tests_and_site_packages(tmp_path, monkeypatch):
    keep = ["os.py", "json/decoder.py", "unittest/case.py", "idlelib/editor.py", "lib2to3/main.py"]
    drop = ["test/test_os.py", "tests/x.py", "idlelib/idle_test/test_editor.py", "lib2to3/tests/test_all.py",
            "site-packages/pkg/mod.py", "dist-packages/pkg/mod.py", "json/__pycache__/x.py", "README.txt"]
    for rel in keep + drop:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_sources()] == sorted(keep)


def test_document_names_keep_symlinked_files_in_their_directory(tmp_path):
    # Debian links some stdlib modules to files under /etc: a name must follow the link's place, not its
    # target's, or the common root (and every name, hence the split) would change.
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "x.py").write_text("x = 1\n")
    (tmp_path / "elsewhere.py").write_text("y = 2\n")
    (corpus / "link.py").symlink_to(tmp_path / "elsewhere.py")
    docs = read_documents([corpus / "a" / "x.py", corpus / "link.py"])
    assert docs == [("a/x.py", "x = 1\n"), ("link.py", "y = 2\n")]


def test_real_stdlib_corpus():
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_sources()
    assert all(str(p).startswith(root) and p.suffix == ".py" for p in files)
    assert not any({"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(p.parts) for p in files)
    megabytes = sum(p.stat().st_size for p in files) / 1e6
    assert 5 < megabytes < 40, megabytes
    names = [name for name, _ in read_documents(files)]
    assert "json/decoder.py" in names  # names are relative to the stdlib root
    assert 0.02 < np.mean([is_validation(n) for n in names]) < 0.10


def _write_docs(directory, count):
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (directory / f"doc{i}.txt").write_text(f"<doc{i:03d}> " * 20)
    return [str(directory / f"doc{i}.txt") for i in range(count)]


def test_split_is_by_file_disjoint_and_deterministic(tmp_path):
    paths = _write_docs(tmp_path / "a", 80)
    streams = build_token_streams(paths, ByteTokenizer())
    text = {split: bytes(tokens).decode() for split, tokens in streams.items()}
    expected_valid = {i for i in range(80) if is_validation(f"doc{i}.txt")}
    assert 0 < len(expected_valid) < 20
    for i in range(80):
        marker = f"<doc{i:03d}>"
        in_train, in_valid = marker in text["train"], marker in text["valid"]
        assert in_train != in_valid, marker
        assert in_valid == (i in expected_valid), marker
    # The split depends on names relative to the corpus, not on where it lies.
    moved = shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "b")
    again = build_token_streams([str(moved / f"doc{i}.txt") for i in range(80)], ByteTokenizer())
    for split in streams:
        np.testing.assert_array_equal(again[split], streams[split])


def test_jsonl_and_text_inputs(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"<line{i}>", "id": i}) for i in range(30)) + "\n\n")
    text = tmp_path / "b.txt"
    text.write_text("<plain text file>")
    docs = dict(read_documents([jsonl, text]))
    assert docs["a.jsonl:1"] == "<line0>" and docs["a.jsonl:30"] == "<line29>" and docs["b.txt"] == "<plain text file>"
    assert len(docs) == 31
    streams = build_token_streams([str(jsonl), str(text)], ByteTokenizer())
    joined = bytes(streams["train"]).decode() + bytes(streams["valid"]).decode()
    assert all(f"<line{i}>" in joined for i in range(30)) and "<plain text file>" in joined and '"id"' not in joined
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2.*'text'"):
        read_documents([bad])


def test_batches_are_seeded_windows():
    tokens = np.arange(10_000, dtype=np.int64)  # token value == position: a row shows where its window starts
    inputs, labels = sample_batch(tokens, 8, 32, seed=1, step=5)
    assert inputs.shape == labels.shape == (8, 32) and inputs.dtype == labels.dtype == torch.int64
    starts = inputs[:, :1]
    assert torch.equal(inputs, starts + torch.arange(32)) and torch.equal(labels, starts + 1 + torch.arange(32))
    assert len(set(starts.flatten().tolist())) == 8
    assert torch.equal(inputs, sample_batch(tokens, 8, 32, seed=1, step=5)[0])  # a function of (seed, step)
    assert not torch.equal(inputs, sample_batch(tokens, 8, 32, seed=1, step=6)[0])
    assert not torch.equal(inputs, sample_batch(tokens, 8, 32, seed=2, step=5)[0])
    whole, whole_labels = sample_batch(tokens[:33], 2, 32, seed=0, step=0)  # the one window there is
    assert torch.equal(whole[1], torch.arange(32)) and torch.equal(whole_labels[0], torch.arange(1, 33))
    with pytest.raises(ValueError, match="seq_length"):
        sample_batch(tokens[:32], 2, 32, seed=0, step=0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batches_shard_disjointly_over_ranks(world):
    tokens = np.random.default_rng(0).integers(0, 256, 50_000)
    inputs, _ = sample_batch(tokens, 8, 16, seed=3, step=2)
    shards = [shard_rows(inputs, rank, world) for rank in range(world)]
    assert all(s.shape == (8 // world, 16) for s in shards)
    # The ranks' rows partition the global batch: disjoint, covering, in rank order.
    assert torch.equal(torch.cat(shards), inputs)
    with pytest.raises(ValueError, match="ranks"):
        shard_rows(inputs, 0, 3)


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    tok.train_from_iterator(["def foo(): return bar"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = build_tokenizer(str(path))
    assert isinstance(hf, HFTokenizer) and hf.unit == "token"
    ids = hf.encode("def foo(): return bar")
    assert ids.dtype == np.int32 and 0 < len(ids) < len("def foo(): return bar")
    assert ids.tolist() == tok.encode("def foo(): return bar").ids
    assert hf.vocab_size == tok.get_vocab_size() and ids.max() < hf.vocab_size


def test_byte_tokenizer():
    tok = build_tokenizer(None)
    ids = tok.encode("aé")
    assert tok.vocab_size == 256 and tok.unit == "byte"
    assert ids.tolist() == [97, 0xC3, 0xA9]
