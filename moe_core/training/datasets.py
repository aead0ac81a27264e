"""The run's train and validation data by kind: a text / JSONL corpus (``data.py``), a blend of Megatron's indexed
datasets (``blend.py``) or SFT conversations (``sft.py``).

Each split is a source with ``batch(batch_size, seed, step, rank, world) -> Batch`` (rank ``rank``'s rows of the
global batch of ``step``, a function of ``(seed, step)``) and ``num_tokens``.
"""

from __future__ import annotations

from moe_core.training.batch import DocumentMasking
from moe_core.training.blend import build_blend, parse_blend
from moe_core.training.config import TrainingConfig
from moe_core.training.data import TokenWindows, build_token_streams
from moe_core.training.indexed_dataset import is_indexed_dataset
from moe_core.training.sft import build_sft
from moe_core.training.tokenizer import load_pretrained_tokenizer


def uses_indexed_data(data_path: list[str] | None) -> bool:
    """Whether ``data_path`` names indexed datasets (weights, or prefixes with ``.bin`` / ``.idx`` files) rather
    than text / JSONL files."""
    if not data_path:
        return False
    prefixes, weights = parse_blend(data_path)
    return weights is not None or is_indexed_dataset(prefixes[0])


def document_masking(cfg: TrainingConfig) -> DocumentMasking | None:
    """The EOD masking of ``reset_position_ids`` / ``reset_attention_mask`` / ``eod_mask_loss``, None without them;
    the EOD token is the end-of-sequence token of ``cfg.tokenizer``'s directory (``tokenizer_config.json``), the
    one ``tools/preprocess_data.py --append-eod`` appends.

    Raises:
        ValueError: a flag is set without indexed data or without a tokenizer that has an end-of-sequence token.
    """
    flags = dict(reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
                 eod_mask_loss=cfg.eod_mask_loss)
    if not any(flags.values()):
        return None
    named = ", ".join(name for name, on in flags.items() if on)
    if not uses_indexed_data(cfg.data_path):
        raise ValueError(f"{named}: need documents that end in an EOD token: indexed datasets written by "
                         "tools/preprocess_data.py --append-eod (--data-path PREFIX); a text corpus has none")
    eod = None if cfg.tokenizer is None else load_pretrained_tokenizer(cfg.tokenizer).eos_token_id
    if eod is None:
        raise ValueError(f"{named}: need the EOD token id: --tokenizer with an eos_token in its tokenizer_config.json, "
                         f"got tokenizer={cfg.tokenizer}")
    return DocumentMasking(eod, **flags)


def build_datasets(cfg: TrainingConfig, tokenizer, seq_length: int, vocab_size: int) -> dict:
    """``{"train": source, "valid": source}`` for ``cfg`` (module docstring); ``tokenizer`` is the run's
    (``tokenizer.build_tokenizer``), ``vocab_size`` the model's.

    Raises:
        ValueError: ``split`` with a text corpus, and the errors of the builders (``build_token_streams``,
            ``build_blend``, ``build_sft``, ``document_masking``).
    """
    if cfg.sft:
        return build_sft(cfg.data_path, cfg.tokenizer, cfg.split, seq_length, vocab_size)
    masking = document_masking(cfg)
    if uses_indexed_data(cfg.data_path):
        return build_blend(cfg.data_path, cfg.split, seq_length, vocab_size, masking)
    if cfg.split is not None:
        raise ValueError(f"split: applies to indexed datasets and SFT data; a text corpus splits by file name, got "
                         f"split={cfg.split!r}")
    streams = build_token_streams(cfg.data_path, tokenizer, *cfg.decode_args())
    return {split: TokenWindows([tokens], seq_length, names=[f"the {split} split"])
            for split, tokens in streams.items()}


__all__ = ["build_datasets", "document_masking", "uses_indexed_data"]
