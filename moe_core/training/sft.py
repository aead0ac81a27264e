"""Supervised fine-tuning data: chat JSONL through the tokenizer's chat template, prompt tokens masked from the
loss, several conversations packed per sequence with document masks.

Legend (docs/design.md): B batch (sequences), S sequence, R packed rows.

Each line of a JSONL file is a conversation in Hugging Face's format, ``{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}``. The chat template (``tokenizer_config.json`` / ``chat_template.jinja`` of
the tokenizer's directory, rendered by transformers) makes its text; the loss trains the tokens of every assistant
turn, from its first token through the template's end of turn, and masks the rest (labels ``IGNORE_INDEX``).
An assistant turn's span is what the template adds to the conversation before it (rendered with the generation
prompt) when the turn is appended, so the template must render a conversation's start the same however it goes
on (ChatML, Llama's and Qwen's templates without reasoning content do).

Conversations are packed in file order into rows of S positions (a conversation of n tokens takes n - 1: inputs
and next-token labels); a longer one is cut to S. Each keeps its own ``document_ids`` and positions from 0, so
attention never crosses conversations and a packed row's loss is the sum of its conversations' losses. The rest
of a row is padding (no loss, a document of its own). ``split`` cuts the conversations into train, validation
and test in file order; the batches of a step take rows by a permutation of each epoch seeded by
``(seed, epoch)``: a function of ``(seed, step)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from moe_core.training.batch import IGNORE_INDEX, Batch
from moe_core.training.blend import DEFAULT_SPLIT, SPLITS, parse_split, split_indices
from moe_core.training.data import read_text, shard_rows
from moe_core.training.tokenizer import load_pretrained_tokenizer


def read_conversations(path: Path) -> list[tuple[str, list[dict]]]:
    """``(file:line, messages)`` per non-blank line of a chat JSONL file.

    Raises:
        ValueError: a line is not JSON, or not an object whose ``messages`` is a non-empty list of objects with
            string ``role`` and ``content``; names the file and line.
    """
    conversations = []
    for i, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"data_path: {path}:{i}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with "
                             "string roles and contents")
        conversations.append((f"{path}:{i}", messages))
    return conversations


def tokenize_conversation(tokenizer, messages: list[dict], where: str = "conversation"
                          ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [n] int64, trained [n] bool)``: the conversation through the chat template, and which tokens lie in
    an assistant turn (module docstring).

    Raises:
        ValueError: the template fails, or renders a conversation's start differently once it goes on; names
            ``where``.
    """
    def render(part: list[dict], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja raises TemplateError and whatever the template raises
            raise ValueError(f"{where}: the chat template failed on messages 0..{len(part) - 1} ({e})") from None

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True) if i else "", render(messages[:i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(f"{where}: the chat template renders the conversation up to message {i} differently "
                             "once later messages follow; the assistant tokens cannot be told from the prompt")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    trained = np.zeros(len(starts), dtype=bool)
    for begin, end in spans:
        trained |= (starts >= begin) & (starts < end)
    return np.asarray(encoded["input_ids"], dtype=np.int64), trained


def pack(samples: list[tuple[np.ndarray, np.ndarray]], seq_length: int, pad_id: int) -> Batch:
    """Rows ``[R, S]`` of conversations ``(ids, trained)`` packed in order (module docstring)."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for ids, trained in samples:
        length = min(len(ids) - 1, seq_length)
        if length <= 0:
            continue
        if used + length > seq_length:
            rows.append([])
            used = 0
        rows[-1].append((ids[:length + 1], trained[:length + 1]))
        used += length
    rows = [row for row in rows if row]
    out = {name: torch.zeros(len(rows), seq_length, dtype=torch.int64) for name in Batch._fields}
    out["input_ids"].fill_(pad_id)
    out["labels"].fill_(IGNORE_INDEX)
    for r, row in enumerate(rows):
        start = 0
        for d, (ids, trained) in enumerate(row):
            n = len(ids) - 1
            out["input_ids"][r, start:start + n] = torch.from_numpy(ids[:-1])
            out["labels"][r, start:start + n] = torch.from_numpy(np.where(trained[1:], ids[1:], IGNORE_INDEX))
            out["position_ids"][r, start:start + n] = torch.arange(n)
            out["document_ids"][r, start:start + n] = d
            start += n
        out["position_ids"][r, start:] = torch.arange(seq_length - start)
        out["document_ids"][r, start:] = len(row)
    return Batch(**out)


class PackedRows:
    """Packed SFT rows drawn by a seeded permutation per epoch: ``batch`` as ``data.TokenWindows.batch``.

    Attributes:
        rows: ``Batch`` of ``[R, S]`` tensors. num_tokens: the conversations' tokens (inputs). num_samples,
            num_truncated: conversations, and those cut to S.
    """

    def __init__(self, rows: Batch, num_samples: int, num_truncated: int, num_tokens: int):
        self.rows, self.num_samples, self.num_truncated, self.num_tokens = rows, num_samples, num_truncated, num_tokens

    def batch(self, batch_size: int, seed: int, step: int, rank: int = 0, world: int = 1) -> Batch:
        """Rank ``rank``'s rows of the global batch of ``step``: positions ``step * batch_size ...`` of the
        sequence of epochs, each a permutation of the R rows seeded by ``(seed, epoch)``."""
        count = len(self.rows.input_ids)
        mine = shard_rows(np.arange(step * batch_size, (step + 1) * batch_size), rank, world)
        permutations = {e: np.random.default_rng([seed, e]).permutation(count) for e in set(mine // count)}
        index = torch.as_tensor([permutations[g // count][g % count] for g in mine], dtype=torch.int64)
        return self.rows.map(lambda t: t[index])


def build_sft(data_path: list[str], tokenizer_path: str | None, split: str | None, seq_length: int,
              vocab_size: int) -> dict[str, PackedRows]:
    """``{"train": rows, "valid": rows}`` of the chat JSONL files ``data_path`` (module docstring).

    Raises:
        ValueError: no tokenizer, or one without a chat template; a malformed line (``read_conversations``), a
            template failure (``tokenize_conversation``), a token id outside ``[0, vocab_size)`` (naming the file
            and line), or an empty train or validation split.
    """
    if tokenizer_path is None:
        raise ValueError("tokenizer: SFT needs a Hugging Face tokenizer with a chat template (--tokenizer "
                         "DIR/tokenizer.json, its tokenizer_config.json beside it), got none")
    tokenizer = load_pretrained_tokenizer(tokenizer_path)
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer: {tokenizer_path} has no chat template (tokenizer_config.json's chat_template or "
                         "chat_template.jinja); SFT renders conversations with it")
    conversations = [c for path in data_path for c in read_conversations(Path(path))]
    bounds = split_indices(parse_split(split or DEFAULT_SPLIT), len(conversations))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    out = {}
    for i, name in enumerate(SPLITS[:2]):
        part = conversations[bounds[i]:bounds[i + 1]]
        if not part:
            raise ValueError(f"data_path: the {name} split of the {len(conversations)} conversations is empty (split "
                             f"{split or DEFAULT_SPLIT})")
        samples = []
        for where, messages in part:
            ids, trained = tokenize_conversation(tokenizer, messages, where)
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"{where}: token id {ids.max()} is outside the model's [0, vocab_size) = "
                                 f"[0, {vocab_size})")
            samples.append((ids, trained))
        rows = pack(samples, seq_length, pad_id)
        truncated = sum(len(ids) - 1 > seq_length for ids, _ in samples)
        out[name] = PackedRows(rows, len(samples), truncated, sum(min(len(ids) - 1, seq_length) for ids, _ in samples))
    return out


__all__ = ["read_conversations", "tokenize_conversation", "pack", "PackedRows", "build_sft"]
