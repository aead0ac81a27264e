"""A SIGSTOPped rank: the other rank fails within --distributed-timeout-minutes with an error naming the
collective it waited in, instead of hanging for gloo's default 30 minutes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.reliability._common import ROOT, TINY, write_corpus

pytestmark = pytest.mark.distributed
TIMEOUT_S = 12.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rows(path) -> int:
    if not path.exists():
        return 0
    return sum('"loss"' in line for line in path.read_text().splitlines())


def test_stopped_rank_makes_the_other_fail_naming_the_collective(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "out"
    flags = TINY + ["--data-path", str(corpus), "--expert-model-parallel-size", "2", "--micro-batch-size", "2",
                    "--train-iters", "100000", "--output-dir", str(out),
                    "--distributed-timeout-minutes", str(TIMEOUT_S / 60)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "MOE_CORE_BACKEND": "gloo", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]  # files: a full pipe would block a rank
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "tools" / "pretrain_gpt.py"), *flags],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while _train_rows(out / "metrics.jsonl") < 2:  # both ranks are in the training loop
            assert time.monotonic() < deadline, "the ranks did not start training"
            assert all(p.poll() is None for p in ranks), (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.2)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        ranks[0].wait(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - stopped_at
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "rank0.log").read_text()
    assert ranks[0].returncode != 0
    assert waited < TIMEOUT_S + 30, f"rank 0 took {waited:.0f} s to fail"
    last = output.strip().splitlines()[-1]
    assert "moe_core.parallel.collective_errors.CollectiveError: rank 0: collective " in last, last
    assert "over ranks [0, 1] did not complete" in last and "Timed out" in last, last
    print(f"rank 0 failed {waited:.1f} s after rank 1 stopped: {last[:300]}")
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] >= 2
