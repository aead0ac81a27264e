"""Run metrics: one JSON line per log step, TensorBoard scalars and histograms, and a loss-curve PNG at the end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class MetricsWriter:
    """Writes ``metrics.jsonl``, TensorBoard events and ``loss_curve.png``; only the logging rank makes one.

    ``output_dir``: directory of the JSONL and PNG. ``tensorboard_dir``: event directory (None:
    ``output_dir/tensorboard``). ``resume_step``: None starts the files afresh; a step (a run resumed from a
    checkpoint of that step) keeps the earlier rows up to it, drops later ones (a run that went on past the
    checkpoint, and the validation row of resume_step, which the resumed run writes again) and appends, so
    the files and the PNG show one trajectory.
    """

    def __init__(self, output_dir: str, tensorboard_dir: str | None = None, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        jsonl = self.dir / "metrics.jsonl"
        kept = []
        if resume_step is not None and jsonl.exists():
            # The resumed run evaluates at resume_step again: drop that validation row, keep the train row.
            kept = [row for row in map(json.loads, jsonl.read_text().splitlines())
                    if row["step"] < resume_step or row["step"] == resume_step and "valid_loss" not in row]
        self._jsonl = open(jsonl, "w")
        self._tb = SummaryWriter(tensorboard_dir or str(self.dir / "tensorboard"), purge_step=resume_step)
        self._train: list[tuple[int, float]] = []
        self._valid: list[tuple[int, float]] = []
        for row in kept:
            self._record(row.pop("step"), row, tensorboard=False)

    def log(self, step: int, values: dict) -> None:
        """Record ``values`` at ``step``; keys ``loss`` and ``valid_loss`` also feed the PNG.

        A value is a number (a TensorBoard scalar), a list of numbers (a TensorBoard histogram) or a dict of such
        values (TensorBoard names ``key/subkey``); the JSON line holds them as given.
        """
        self._record(step, values, tensorboard=True)

    def _record(self, step: int, values: dict[str, float], tensorboard: bool) -> None:
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if tensorboard:
            self._write_tensorboard(step, values)
        if "loss" in values:
            self._train.append((step, values["loss"]))
        if "valid_loss" in values:
            self._valid.append((step, values["valid_loss"]))

    def _write_tensorboard(self, step: int, values: dict, prefix: str = "") -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                self._write_tensorboard(step, value, f"{prefix}{key}/")
            elif isinstance(value, list):
                self._tb.add_histogram(prefix + key, np.asarray(value, dtype=np.float64), step)
            else:
                self._tb.add_scalar(prefix + key, value, step)

    def close(self, title: str) -> Path:
        """Flush, draw the loss curves and return the PNG's path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self._tb.close()
        self._jsonl.close()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for points, label in ((self._train, "train"), (self._valid, "validation")):
            if points:
                ax.plot(*zip(*points, strict=True), label=label, marker="o" if label == "validation" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.dir / "loss_curve.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path


__all__ = ["MetricsWriter"]
