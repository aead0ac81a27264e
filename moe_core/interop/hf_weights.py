"""Where each ``GPTModel`` parameter lives in a Hugging Face checkpoint, and reading rows of it lazily.

Legend: L layers, H hidden, V vocabulary, Nq / Nkv query / key-value heads, D head dim, E experts, F expert
(or dense) ffn width.

A moe_core parameter is either row blocks of HF tensors stacked along dim 0 (``RowConcat``: ``linear_qkv``
holds each query group's q heads, k head and v head in turn, Megatron's layout ``qkv_row_blocks``; a dense
``linear_fc1`` is gate, up) or a ``GroupedMLP`` weight whose expert e is HF's per-expert tensors
stacked and transposed (``ExpertStack``: ``linear_fc1[e] [H, 2F] = cat(gate_e [F, H], up_e [F, H]).T``, gate
half first; ``linear_fc2[e] [F, H] = down_e.T``). HF checkpoints keep one tensor per expert (the Hub's layout, and what
``save_pretrained`` writes), so a rank can read exactly the experts and rows it holds.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from moe_core.config import TransformerConfig
from moe_core.interop.hf_config import hf_architecture
from moe_core.interop.hf_files import open_safetensors, weight_files
from moe_core.models.attention import qkv_row_blocks

# (MoE block, gate, up, down) names of the HF expert tensors.
EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


@dataclass(frozen=True)
class RowConcat:
    """A moe_core tensor whose rows are ``pieces`` ((key, start, stop), ...) stacked along dim 0: rows
    ``start:stop`` of HF tensor ``key``, in order; together the blocks of a key cover all its rows."""

    pieces: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ExpertStack:
    """A ``GroupedMLP`` weight ``[E, in, out]``: expert e is ``cat(pieces, dim 0).T``, each piece ``(key
    template with {e}, rows)`` an HF tensor ``[rows, in]``."""

    pieces: tuple[tuple[str, int], ...]
    num_experts: int

    def keys(self, expert: int) -> list[str]:
        return [template.format(e=expert) for template, _ in self.pieces]


def weight_map(config: TransformerConfig) -> dict[str, RowConcat | ExpertStack]:
    """Every ``GPTModel(config)`` parameter name -> where it lives in the HF checkpoint of
    ``hf_architecture(config)``."""
    c = config
    arch = hf_architecture(c)
    block, gate, up, down = EXPERT_NAMES[arch]
    heads_q, heads_kv, dim = c.num_attention_heads, c.num_query_groups, c.kv_channels
    hidden = c.hidden_size

    def one(key: str, rows: int) -> RowConcat:
        return RowConcat(((key, 0, rows),))

    out: dict[str, RowConcat | ExpertStack] = {"embedding.weight": one("model.embed_tokens.weight", c.vocab_size)}
    for i in range(c.num_layers):
        ours, attn, theirs = f"decoder.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}"
        out[f"{ours}.input_layernorm.weight"] = one(f"{theirs}.input_layernorm.weight", hidden)
        out[f"{ours}.self_attention.linear_qkv.weight"] = RowConcat(tuple(
            (f"{attn}.{section}_proj.weight", start, stop)
            for section, start, stop in qkv_row_blocks(heads_q, heads_kv, dim)))
        out[f"{ours}.self_attention.linear_proj.weight"] = one(f"{attn}.o_proj.weight", hidden)
        if c.qk_layernorm:
            per_head = c.qk_layernorm_span == "head"
            out[f"{ours}.self_attention.q_layernorm.weight"] = one(f"{attn}.q_norm.weight",
                                                                   dim if per_head else heads_q * dim)
            out[f"{ours}.self_attention.k_layernorm.weight"] = one(f"{attn}.k_norm.weight",
                                                                   dim if per_head else heads_kv * dim)
        out[f"{ours}.pre_mlp_layernorm.weight"] = one(f"{theirs}.post_attention_layernorm.weight", hidden)
        if c.is_moe_layer(i):
            moe, ffn, experts = f"{theirs}.{block}", c.moe_ffn_hidden_size, c.num_moe_experts
            out[f"{ours}.mlp.router.weight"] = one(f"{moe}.gate.weight", experts)
            out[f"{ours}.mlp.experts.linear_fc1.weight"] = ExpertStack(
                ((f"{moe}.experts.{{e}}.{gate}.weight", ffn), (f"{moe}.experts.{{e}}.{up}.weight", ffn)), experts)
            out[f"{ours}.mlp.experts.linear_fc2.weight"] = ExpertStack(
                ((f"{moe}.experts.{{e}}.{down}.weight", hidden),), experts)
        else:
            ffn = c.ffn_hidden_size
            out[f"{ours}.mlp.linear_fc1.weight"] = RowConcat(
                ((f"{theirs}.mlp.gate_proj.weight", 0, ffn), (f"{theirs}.mlp.up_proj.weight", 0, ffn)))
            out[f"{ours}.mlp.linear_fc2.weight"] = one(f"{theirs}.mlp.down_proj.weight", hidden)
    out["decoder.final_layernorm.weight"] = one("model.norm.weight", hidden)
    if not c.share_embeddings_and_output_weights:
        out["output_layer.weight"] = one("lm_head.weight", c.vocab_size)
    return out


def hf_shapes(sources: dict[str, RowConcat | ExpertStack], shapes: dict[str, torch.Size]
              ) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's shape, from the moe_core parameters' (global) ``shapes`` by name."""
    out: dict[str, tuple[int, ...]] = {}
    for name, src in sources.items():
        if isinstance(src, RowConcat):
            for key, _, stop in src.pieces:
                out[key] = (max(stop, out.get(key, (0,))[0]), *shapes[name][1:])
        else:
            for e in range(src.num_experts):
                out.update({key: (rows, shapes[name][1]) for key, (_, rows) in zip(src.keys(e), src.pieces,
                                                                                    strict=True)})
    return out


def hf_directory(path: str | Path) -> Path:
    """The checkpoint directory of ``path``: itself, or the directory of a file in it (``config.json``)."""
    path = Path(path)
    return path.parent if path.is_file() else path


class SafetensorsReader:
    """Rows of the tensors of an HF directory's safetensors files (``model.safetensors``, or the shards of
    ``model.safetensors.index.json``, ``hf_files.weight_files``), read lazily: only the rows asked for leave the
    file.

    Counts the elements read per key in ``elements_read``. Use as a context manager (closes the files).

    Raises:
        FileNotFoundError: the directory has neither file, or a shard the index names is missing.
        ValueError: an index entry that leads outside the directory; a damaged file, a tensor its file lacks,
            or rows holding NaN or Inf (each named with the file and the tensor).
    """

    def __init__(self, directory: str | Path):
        self.files = weight_files(hf_directory(directory))
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self.elements_read: dict[str, int] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, key: str):
        path = self.files[key]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(open_safetensors(path))
        try:
            return self._handles[path].get_slice(key)
        except SafetensorError as e:
            raise ValueError(f"{path}: tensor {key}: {e}") from e

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """Tensor ``key``'s safetensors dtype name: ``"F32"``, ``"BF16"``, ``"I64"``, ``"BOOL"``, ..."""
        return self._slice(key).get_dtype()

    def rows(self, key: str, start: int, stop: int, columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``key`` (dim 0), only ``columns`` ``(first, last)`` of dim 1 when given
        (safetensors reads just those bytes), checked finite."""
        block = self._slice(key)[start:stop] if columns is None else self._slice(key)[start:stop, columns[0]:columns[1]]
        if not bool(torch.isfinite(block if block.element_size() > 1 else block.float()).all()):
            raise ValueError(f"{self.files[key]}: tensor {key} holds NaN or Inf (in rows {start}:{stop}); refusing "
                             "to load it")
        self.elements_read[key] = self.elements_read.get(key, 0) + block.numel()
        return block


@torch.no_grad()
def fill_rows(dest: torch.Tensor, src: RowConcat | ExpertStack, reader: SafetensorsReader, start: int,
              column: int | None = None) -> None:
    """Copy rows ``[start, start + len(dest))`` of the moe_core tensor ``src`` describes into ``dest``
    (dtype and device converted), reading only those rows (for ``ExpertStack``: those experts); with
    ``column``, only dim-1 entries ``[column, column + dest.shape[1])`` of a ``RowConcat``."""
    stop = start + dest.shape[0]
    columns = None if column is None else (column, column + dest.shape[1])
    if isinstance(src, ExpertStack):
        for row, expert in enumerate(range(start, stop)):
            pieces = [reader.rows(key, 0, rows) for key, (_, rows) in zip(src.keys(expert), src.pieces, strict=True)]
            dest[row].copy_(torch.cat(pieces).t())
        return
    offset = 0
    for key, first, last in src.pieces:
        lo, hi = max(start, offset), min(stop, offset + last - first)
        if lo < hi:
            dest[lo - start:hi - start].copy_(reader.rows(key, first + lo - offset, first + hi - offset, columns))
        offset += last - first


def hf_tensors(src: RowConcat | ExpertStack, value: torch.Tensor):
    """The HF tensors ``(key, tensor)`` of the full moe_core tensor ``value`` (contiguous, own storage)."""
    if isinstance(src, RowConcat):
        blocks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        parts = value.split([last - first for _, first, last in src.pieces])
        for (key, first, _), part in zip(src.pieces, parts, strict=True):
            blocks.setdefault(key, []).append((first, part))
        for key, ordered in blocks.items():
            yield key, torch.cat([part for _, part in sorted(ordered, key=lambda b: b[0])])
        return
    for expert in range(src.num_experts):
        parts = value[expert].t().split([r for _, r in src.pieces])
        for key, part in zip(src.keys(expert), parts, strict=True):
            yield key, part.clone(memory_format=torch.contiguous_format)


__all__ = ["EXPERT_NAMES", "hf_directory", "RowConcat", "ExpertStack", "weight_map", "hf_shapes", "SafetensorsReader",
           "fill_rows", "hf_tensors"]
