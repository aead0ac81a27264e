"""Tokenizers: raw bytes (vocab 256, the default) or a Hugging Face ``tokenizer.json`` via ``tokenizers``."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``vocab_size`` 256, losses are in nats per byte."""

    vocab_size = 256
    unit = "byte"

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``[n]`` uint8 (n = its UTF-8 length)."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (Rust, fast batch encoding)."""

    unit = "token"

    def __init__(self, path: str):
        """Raises ``ValueError`` naming ``path`` (and the line and column the parser gives) when the file is
        missing or not a valid tokenizer.json."""
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception
            raise ValueError(f"tokenizer: {path}: not a loadable Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``[n]`` int32 token ids."""
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int32)


def build_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """``ByteTokenizer`` when ``path`` is None, else ``HFTokenizer(path)``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


__all__ = ["ByteTokenizer", "HFTokenizer", "build_tokenizer"]
