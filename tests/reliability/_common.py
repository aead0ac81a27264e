"""What the fault-injection tests share: a tiny model's flags, a corpus file, running the CLI in a subprocess."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import pretrain_gpt  # noqa: E402

RUNNER = Path(__file__).with_name("_pretrain_with_fault.py")
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
        "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "4",
        "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "1",
        "--moe-input-jitter-eps", "0.1"]


def write_corpus(path: Path) -> Path:
    """One text file of ~30 KB (a one-file corpus: the data module splits it by tokens)."""
    rng = random.Random(0)
    words = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "print", "None"]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(600)))
    return path


def run_cli(flags: list[str], *, fault: str | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """tools/pretrain_gpt.py in a fresh process (through the fault runner), with this process's torch thread
    count so its floats match an in-process run bitwise."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "MOE_CORE_THREADS": str(torch.get_num_threads()),
                **(env or {})}
    full_env.pop("MOE_CORE_FAULT", None)
    if fault:
        full_env["MOE_CORE_FAULT"] = fault
    return subprocess.run([sys.executable, str(RUNNER), *flags], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def parse(flags: list[str]):
    """``(TransformerConfig, TrainingConfig)`` of the CLI's flags."""
    return pretrain_gpt.parse_args(flags)
