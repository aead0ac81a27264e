#!/usr/bin/env python3
"""Document masking's cost and the data loader's stall on one GPU, in one run: a config trained on batches of a
synthetic indexed dataset with plain causal attention, then with Megatron's document masks, on the same batches.

    python3 tools/bench_document_mask.py --json $OUT/document_mask.json     # configs/gpu_b.yaml, compiled layers
    python3 tools/bench_document_mask.py --smoke --json smoke.json          # a tiny model, a few steps (the CI test)

The dataset: documents of exponentially distributed lengths (mean ``--document-tokens``), random ids below the
vocabulary's last, each ending with the last id as its EOD token, written with ``IndexedDatasetBuilder`` to a
temporary directory and read back memory-mapped. Both rows run the trainer's own path: ``data.TokenWindows``
over the memory map (the same seed, so the same windows), the ``loader.Prefetcher`` thread, the trainer's default
execution path (``fast_path``: CUDA graphs for compiled layers on one GPU), ``step.train_step``; the
``document`` row adds ``--reset-attention-mask --reset-position-ids --eod-mask-loss`` (FlexAttention block masks on
CUDA). Per row: ``--warmup`` steps (compilation), then ``--steps`` steps timed with CUDA events (median, 10-90
percentile spread), tokens/s, the time each timed step waited for its batch (mean ms, and its share of the median
step), and for the ``document`` row its step time over the ``causal`` row's (the issue's target: at most 1.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import error_message, fmt, free_memory, ratio, run_metadata, single_thread, timed  # noqa: E402
from _bench_common import print_table as print_rows  # noqa: E402

from moe_core import TransformerConfig  # noqa: E402
from moe_core.training.batch import DocumentMasking  # noqa: E402
from moe_core.training.config import TrainingConfig  # noqa: E402
from moe_core.training.data import TokenWindows  # noqa: E402
from moe_core.training.fast_path import resolve_fast_path  # noqa: E402
from moe_core.training.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype  # noqa: E402
from moe_core.training.loader import Prefetcher  # noqa: E402
from moe_core.training.step import setup_training, train_step, training_device  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "gpu_b.yaml")
ATTENTION = ("causal", "document")


def write_corpus(prefix: Path, tokens: int, mean_document: int, vocab_size: int, seed: int = 0) -> int:
    """A synthetic indexed dataset of about ``tokens`` ids at ``prefix``; returns its EOD id (``vocab_size - 1``)."""
    rng = np.random.default_rng(seed)
    eod = vocab_size - 1
    with IndexedDatasetBuilder(prefix, optimal_dtype(vocab_size)) as builder:
        written = 0
        while written < tokens:
            length = 1 + int(rng.exponential(mean_document))
            builder.add_document(np.append(rng.integers(0, eod, length - 1), eod))
            written += length
        builder.finalize()
    return eod


def bench_row(model_config: TransformerConfig, training: TrainingConfig, prefix: Path, masking, args) -> dict:
    """One row: setup_training, then steps fed by the Prefetcher over the corpus's windows."""
    device = training_device(None)
    windows = TokenWindows([IndexedDataset(prefix).tokens], model_config.seq_length, names=[str(prefix)],
                           vocab_size=model_config.vocab_size, masking=masking)
    model_config, training, _ = resolve_fast_path(model_config, training, None, device)
    state = setup_training(model_config, training)
    global_batch = state.tokens_per_step // model_config.seq_length
    total = args.warmup + args.steps + 1
    waits = []
    batches = Prefetcher(lambda step: windows.batch(global_batch, training.seed, step), range(total), device)

    def step():
        batch, waited = batches.next()
        waits.append(waited)
        return train_step(state, *batch)[0]

    first_loss = step().item()
    row = timed(step, args.steps, max(args.warmup - 1, 0), device)
    timed_waits = waits[-args.steps:]
    batches.close()
    wait_ms = 1e3 * sum(timed_waits) / len(timed_waits)
    row.update(first_loss=first_loss, tokens_per_step=state.tokens_per_step, cuda_graph=training.enable_cuda_graph,
               tokens_per_s=state.tokens_per_step / (row["median_ms"] / 1e3), data_wait_ms=wait_ms,
               data_wait_fraction=wait_ms / row["median_ms"])
    return row


def run(args) -> list[dict]:
    if args.smoke:
        model_config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_moe_experts=4,
                                         moe_router_topk=2, moe_ffn_hidden_size=16, seq_length=64)
        training = TrainingConfig(micro_batch_size=2, compile=False)
    else:
        model_config, training = TransformerConfig.from_yaml(args.config), TrainingConfig.from_yaml(args.config)
        training = dataclasses.replace(training, compile=not args.no_compile,
                                       enable_cuda_graph=False if args.no_cuda_graph else None)
    tokens = 4 * (args.warmup + args.steps + 1) * training.micro_batch_size * (model_config.seq_length + 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, single_thread(args.smoke):
        prefix = Path(tmp) / "corpus"
        eod = write_corpus(prefix, tokens, args.document_tokens, model_config.vocab_size)
        for attention in ATTENTION:
            masked = attention == "document"
            masking = DocumentMasking(eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
            masking = masking if masked else None
            row = dict(config=Path(args.config).stem if not args.smoke else "smoke", attention=attention,
                       document_tokens=args.document_tokens, compile=training.compile)
            try:
                row.update(bench_row(model_config, dataclasses.replace(training, eod_mask_loss=masked), prefix,
                                     masking, args))
            except Exception as err:  # noqa: BLE001  (compile failure, OOM: recorded, the other row goes on)
                row["error"] = error_message(err)
                print(f"  {attention}: {row['error']}", file=sys.stderr, flush=True)
            rows.append(row)
            torch._dynamo.reset()
            free_memory()
    rows[1]["vs_causal"] = ratio(rows[1].get("median_ms"), rows[0].get("median_ms"))
    return rows


def print_table(rows: list[dict]) -> None:
    print_rows(rows, [("config", 10), ("attention", 10)], [
        ("step ms", 9, lambda r: f"{r['median_ms']:.2f}"), ("spread", 7, lambda r: f"{100 * r['spread']:.1f}%"),
        ("tokens/s", 10, lambda r: f"{r['tokens_per_s']:.0f}"), ("wait ms", 8, lambda r: f"{r['data_wait_ms']:.3f}"),
        ("wait %", 7, lambda r: f"{100 * r['data_wait_fraction']:.2f}"),
        ("vs causal", 9, lambda r: fmt(r.get("vs_causal"), ".3f")),
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--config", default=CONFIG, help="YAML with model: and training: sections")
    parser.add_argument("--document-tokens", type=int, help="mean document length in tokens (default 1024; --smoke 24)")
    parser.add_argument("--steps", type=int, help="timed steps (default 20; --smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, compilation included (default 5; --smoke 1)")
    parser.add_argument("--no-compile", action="store_true", help="eager layers (the YAML's compile otherwise)")
    parser.add_argument("--no-cuda-graph", action="store_true", help="compiled layers without CUDA graphs")
    parser.add_argument("--smoke", action="store_true", help="a tiny built-in model instead of --config")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 20)
    args.document_tokens = args.document_tokens or (24 if args.smoke else 1024)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_document_mask: needs a CUDA device (or --smoke)")
    rows = run(args)
    print_table(rows)
    if args.json:
        meta = dict(run_metadata(training_device(None)), args=vars(args))
        Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
