"""kill -9 at several points of a save: --load resumes from the checkpoint ``latest`` names, with the losses
of the run that was never killed, bit for bit, and a later save cleans up what the kill left."""

from __future__ import annotations

import signal

import pytest

from moe_core.training.trainer import pretrain
from tests.reliability._common import TINY, parse, run_cli, write_corpus

# Saves at steps 2, 4, 6 and 8; two kept.
RUN = ["--train-iters", "8", "--save-interval", "2", "--save-keep", "2"]

# (fault, the step --load must resume from): the n-th call of a file-system operation during the save of a
# step, in the order a save makes them.
KILLS = [
    ("write_item:3@4", 2),  # DCP half-way through the data file of step 4
    ("fsync:1@4", 2),  # data file written, no .metadata yet
    ("rename:1@4", 2),  # DCP's .metadata.tmp written, not yet renamed
    ("fsync:4@4", 2),  # state.json and manifest written, step_4.tmp not yet published
    ("replace:1@4", 2),  # step_4/ published, ``latest`` not yet replaced: still step_2
    ("unlink:1@6", 6),  # step_6 published and ``latest``, step_2 half-way through its deletion
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that is never killed: its per-step losses."""
    tmp = tmp_path_factory.mktemp("straight")
    corpus = write_corpus(tmp / "corpus.txt")
    model, training = parse(TINY + RUN + ["--data-path", str(corpus), "--output-dir", str(tmp / "out")])
    return corpus, pretrain(model, training, log=lambda *_: None).train_losses


@pytest.mark.parametrize("fault, resume_step", KILLS, ids=[k[0] for k in KILLS])
def test_kill_during_save_loses_nothing(tmp_path, straight, fault, resume_step):
    corpus, straight_losses = straight
    save = tmp_path / "ckpt"
    flags = TINY + RUN + ["--data-path", str(corpus), "--save", str(save)]
    killed = run_cli(flags + ["--output-dir", str(tmp_path / "killed")], fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (save / "latest").read_text() == f"step_{resume_step}\n"

    model, training = parse(flags + ["--load", str(save), "--output-dir", str(tmp_path / "resumed")])
    resumed = pretrain(model, training, log=lambda *_: None)
    assert len(resumed.train_losses) == 8 - resume_step
    assert resumed.train_losses == straight_losses[resume_step:]  # bitwise
    # The resumed run's saves publish over what the kill left: the two newest complete, nothing else.
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step_6", "step_8"]
    assert (save / "latest").read_text() == "step_8\n"

