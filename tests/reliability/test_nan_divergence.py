"""A diverging run (the issue's --lr 1e6 --clip-grad 0 --save-interval 1) skips its non-finite steps, stops
with a clear message and exit status 1 after --max-skipped-steps, and every checkpoint it wrote is finite."""

from __future__ import annotations

import json

import torch

from moe_core.training.checkpoint import load_checkpoint
from moe_core.training.step import setup_training
from tests.reliability._common import TINY, parse, run_cli, write_corpus


def test_diverging_run_stops_and_never_saves_non_finite_weights(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    save = tmp_path / "ckpt"
    flags = TINY + ["--data-path", str(corpus), "--lr", "1e6", "--min-lr", "0", "--clip-grad", "0",
                    "--save-interval", "1", "--save-keep", "50", "--train-iters", "30", "--max-skipped-steps", "2",
                    "--save", str(save), "--output-dir", str(tmp_path / "out")]
    run = run_cli(flags)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "training diverged: 3 steps had a non-finite loss or gradient norm, more than max_skipped_steps (2)" \
        in run.stderr
    assert run.stdout.count("skipped, loss") == 3
    checkpoints = sorted(p for p in save.iterdir() if p.name.startswith("step_"))
    assert checkpoints, "the run saved before it diverged"
    model, training = parse(flags)
    for path in checkpoints:
        state = setup_training(model, training)
        load_checkpoint(path, state.model, state.optimizer, state.scheduler, seed=training.seed, model_config=model)
        for name, tensor in state.model.state_dict().items():
            assert torch.isfinite(tensor).all(), f"{path.name}: {name}"
        for moments in state.optimizer.state.values():
            assert all(torch.isfinite(m).all() for m in moments.values()), path.name
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # The metrics count the skips; the third one stopped the run before its row.
    counts = [row["skipped_steps"] for row in rows if "loss" in row]
    assert counts[-2:] == [1, 2] and set(counts[:-2]) == {0}
