"""tools/bench_document_mask.py --smoke: a causal and a document-masked row over the same synthetic indexed
corpus, each with its step time, data wait and (the masked one) its ratio to causal."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_document_mask as bench  # noqa: E402

from moe_core.training.indexed_dataset import IndexedDataset  # noqa: E402


def test_smoke_rows(tmp_path):
    rows = bench.main(["--smoke", "--json", str(tmp_path / "rows.json")])
    assert [r["attention"] for r in rows] == ["causal", "document"]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["median_ms"] > 0 and row["iters"] == 2 and 0 <= row["data_wait_fraction"] < 1
    assert rows[1]["vs_causal"] == rows[1]["median_ms"] / rows[0]["median_ms"]
    assert rows[0]["first_loss"] != rows[1]["first_loss"]  # the same batches, masked differently
    assert json.loads((tmp_path / "rows.json").read_text())["rows"] == json.loads(json.dumps(rows))


def test_corpus_documents_end_with_the_eod_token(tmp_path):
    eod = bench.write_corpus(tmp_path / "c", 5_000, 40, vocab_size=300)
    data = IndexedDataset(tmp_path / "c")
    assert eod == 299 and data.dtype == np.uint16 and len(data.tokens) >= 5_000
    ends = data.sequence_token_offsets()[1:] - 1
    assert (data.tokens[ends] == eod).all() and (data.tokens == eod).sum() == len(data)
    assert 20 < np.mean(data.sequence_lengths) < 80
