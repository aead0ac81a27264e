"""Document-causal attention: a token attends to the tokens before it in its own document only (Megatron's
``--reset-attention-mask``, torchtitan's ``block_causal``), for sequences that pack several documents.

Legend (docs/design.md): B batch, S sequence, Nq / Nkv heads, D head dim; X blocks of 128 tokens.

``document_causal_mask`` builds the mask once per forward from ``document_ids [B, S]``; every layer shares it.
On CUDA it is a FlexAttention ``BlockMask``: ``flex_attention`` (compiled, here or inside a compiled layer) skips
the 128 x 128 blocks that lie wholly in the future or in other documents, so packing costs no attention FLOPs
beyond the documents' own. The block structure comes from each block's smallest and largest document id (a few
small tensor ops; ``create_block_mask`` would evaluate the mask at all B x S x S points every forward). Elsewhere
it is a boolean ``[B, 1, S, S]`` mask for SDPA: FlexAttention has no backward on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

AttentionMask = BlockMask | torch.Tensor
_BLOCK = 128  # FlexAttention's default block size, both sides
_compiled_flex_attention = torch.compile(flex_attention, dynamic=False)


def use_flex(device: torch.device) -> bool:
    """Whether masks on ``device`` are FlexAttention block masks (CUDA) rather than SDPA boolean masks."""
    return device.type == "cuda"


def document_causal_mask(document_ids_BS: torch.Tensor, flex: bool | None = None) -> AttentionMask:
    """The mask that lets query i see key j when ``j <= i`` and both lie in the same document.

    Args:
        document_ids_BS: ``[B, S]`` integer, each token's document (any ids; equal ids are one document).
        flex: a ``BlockMask`` (True) or a boolean ``[B, 1, S, S]`` tensor, True where attention is allowed
            (False); None: ``use_flex`` of the ids' device.
    Raises:
        ValueError: ``document_ids_BS`` is not a 2-D integer tensor.
    """
    if document_ids_BS.dim() != 2 or document_ids_BS.dtype.is_floating_point or document_ids_BS.dtype == torch.bool:
        raise ValueError(f"document_ids: expected [B, S] integer ids, got {document_ids_BS.dtype} of shape "
                         f"{tuple(document_ids_BS.shape)}")
    batch, seq = document_ids_BS.shape
    if flex is None:
        flex = use_flex(document_ids_BS.device)
    if not flex:
        positions = torch.arange(seq, device=document_ids_BS.device)
        causal_SS = positions[:, None] >= positions[None, :]
        same_BSS = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
        return (causal_SS & same_BSS).unsqueeze(1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx])

    return _block_mask(document_ids_BS, mask_mod)


def _block_mask(document_ids_BS: torch.Tensor, mask_mod) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod`` from per-block id ranges (X blocks of ``_BLOCK`` tokens, the last one
    padded). Query block i meets key block j when ``j <= i`` and their id ranges overlap (exact for ids that
    never decrease along a row, as packed documents' do; any ids stay correct, the mask_mod deciding inside the
    block). It is full, the mask_mod skipped, when ``j < i`` and both blocks hold one and the same id."""
    batch, seq = document_ids_BS.shape
    blocks = -(-seq // _BLOCK)
    padded = torch.cat([document_ids_BS, document_ids_BS[:, -1:].expand(batch, blocks * _BLOCK - seq)], dim=1)
    lowest_BX, highest_BX = padded.view(batch, blocks, _BLOCK).aminmax(dim=-1)
    index_X = torch.arange(blocks, device=document_ids_BS.device)
    causal_XX, past_XX = index_X[None, :] <= index_X[:, None], index_X[None, :] < index_X[:, None]
    q_lo, q_hi, k_lo, k_hi = lowest_BX[:, :, None], highest_BX[:, :, None], lowest_BX[:, None], highest_BX[:, None]
    meets_BXX = causal_XX & (k_hi >= q_lo) & (k_lo <= q_hi)
    full_BXX = past_XX & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    if seq % _BLOCK:  # the padded block is never full
        full_BXX[:, -1] = False
        full_BXX[:, :, -1] = False
    counts, indices = [], []
    for blocks_BXX in (meets_BXX & ~full_BXX, full_BXX):
        counts.append(blocks_BXX.sum(-1, dtype=torch.int32)[:, None])  # [B, 1, X]
        order = torch.argsort(blocks_BXX.to(torch.int8), dim=-1, descending=True, stable=True)
        indices.append(order.to(torch.int32)[:, None])  # [B, 1, X, X]: each row's blocks first
    return BlockMask.from_kv_blocks(counts[0], indices[0], counts[1], indices[1], BLOCK_SIZE=_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(seq, seq))


def masked_attention(q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, mask: AttentionMask,
                     enable_gqa: bool = False) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D) + mask) v`` with a mask of ``document_causal_mask``: ``[B, Nq, S, D]`` in q's dtype.

    ``k`` / ``v`` have Nkv heads, Nq a multiple of them with ``enable_gqa``. A ``BlockMask`` runs
    ``flex_attention``, compiled on CUDA (in eager mode its own compiled function; inside a compiled layer the
    layer's graph); on the CPU eagerly, forward only. A boolean mask runs SDPA.
    """
    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, attn_mask=mask, enable_gqa=enable_gqa)
    flex = flex_attention
    if q_BNSD.is_cuda and not torch.compiler.is_compiling():
        flex = _compiled_flex_attention
    return flex(q_BNSD, k_BNSD, v_BNSD, block_mask=mask, enable_gqa=enable_gqa)


__all__ = ["AttentionMask", "use_flex", "document_causal_mask", "masked_attention"]
