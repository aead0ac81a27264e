"""Tokenizers: raw bytes (vocab 256, the default) or a Hugging Face ``tokenizer.json`` via ``tokenizers``; and
a tokenizer directory through transformers (chat templates, Megatron's ``HuggingFaceTokenizer``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_core.config import require_regular_file


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``vocab_size`` 256, losses are in nats per byte."""

    vocab_size = 256
    unit = "byte"

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``[n]`` uint8 (n = its UTF-8 length)."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (Rust, fast batch encoding).

    ``vocab_size`` is the largest token id (added tokens included) plus one, the embedding rows its ids need: a
    vocabulary with gaps in its ids has fewer tokens than that (``tokenizers``' ``get_vocab_size`` counts tokens).
    """

    unit = "token"

    def __init__(self, path: str):
        """Raises ``ValueError`` naming ``path`` (and the line and column the parser gives) when the file is
        missing, not a regular file, not a valid tokenizer.json, or has no tokens."""
        from tokenizers import Tokenizer

        require_regular_file("tokenizer", path)
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception
            raise ValueError(f"tokenizer: {path}: not a loadable Hugging Face tokenizer.json ({e})") from None
        ids = self._tokenizer.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError(f"tokenizer: {path}: the vocabulary is empty")
        self.vocab_size = max(ids) + 1

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``[n]`` int32 token ids."""
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int32)


def load_pretrained_tokenizer(path: str | Path):
    """transformers' ``AutoTokenizer`` of a local tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``,
    the chat template), or of the directory holding ``path`` when it is a ``tokenizer.json``. Nothing is
    downloaded: ``path`` must exist.

    Raises:
        ValueError: ``path`` does not exist or transformers cannot load a tokenizer from it; names the path.
    """
    from transformers import AutoTokenizer

    directory = Path(path)
    if directory.is_file():
        directory = directory.parent
    if not directory.is_dir():
        raise ValueError(f"tokenizer: {path}: expected a tokenizer directory or its tokenizer.json, found nothing")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ... by file kind
        raise ValueError(f"tokenizer: {directory}: transformers cannot load a tokenizer from it ({e})") from None


def build_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """``ByteTokenizer`` when ``path`` is None, else ``HFTokenizer(path)``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


__all__ = ["ByteTokenizer", "HFTokenizer", "build_tokenizer", "load_pretrained_tokenizer"]
