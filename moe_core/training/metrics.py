"""Run metrics: one JSON line per log step, TensorBoard scalars, and a loss-curve PNG at the end."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    """Writes ``metrics.jsonl``, TensorBoard events and ``loss_curve.png`` under ``output_dir``.

    Only the rank that logs should create one.
    """

    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._train: list[tuple[int, float]] = []
        self._valid: list[tuple[int, float]] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at ``step``; keys ``loss`` and ``valid_loss`` also feed the PNG."""
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            self._tb.add_scalar(key, value, step)
        if "loss" in values:
            self._train.append((step, values["loss"]))
        if "valid_loss" in values:
            self._valid.append((step, values["valid_loss"]))

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
                ax.plot(*zip(*points), label=label, marker="o" if label == "validation" else None)
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
