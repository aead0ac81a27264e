"""A Megatron-style decoder-only GPT with dense or MoE MLPs (Megatron's ``GPTModel``).

Legend (docs/design.md): B batch, S sequence, T = B * S tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moe_core.config import TransformerConfig
from moe_core.models.cross_entropy import chunked_cross_entropy
from moe_core.models.document_mask import document_causal_mask
from moe_core.models.transformer_block import TransformerBlock
from moe_core.moe.moe_layer import MoELayer
from moe_core.parallel.process_groups import ProcessGroupCollection, check_ep_size, check_tp_sizes
from moe_core.parallel.tp_weights import tp_full


class GPTModel(nn.Module):
    """``embedding`` -> ``decoder`` (``TransformerBlock``: pre-norm layers, final RMSNorm) -> ``output_layer``.

    The output projection is ``embedding.weight`` itself when ``share_embeddings_and_output_weights`` (then
    ``output_layer`` is None), else its own ``nn.Linear(H, V, bias=False)``. Init: embedding and output weights
    normal(0, init_method_std); see ``SelfAttention`` and ``MLP`` for the rest.

    Under tensor parallelism the model is built whole and split by
    ``moe_core.models.tp_plan.apply_tensor_parallel`` before its first forward; each TP rank then
    computes the loss of its slice of the sequence and the forward returns the whole ``[B, S]`` loss.

    Args:
        config: ``TransformerConfig``.
        pg_collection: the process groups (this rank then holds ``num_moe_experts / EP`` experts per MoE
            layer), or None for one rank holding every expert.
    Raises:
        ValueError: the EP, TP or ETP size of ``pg_collection`` (1 for None) differs from the config's.
    """

    def __init__(self, config: TransformerConfig, pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        check_ep_size(config.expert_model_parallel_size, pg_collection)
        check_tp_sizes(config, pg_collection)
        self.config = config
        self.tp_mesh = None if pg_collection is None else pg_collection.tp_mesh
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=config.init_method_std)
        self.decoder = TransformerBlock(config, pg_collection)
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            nn.init.normal_(self.output_layer.weight, mean=0.0, std=config.init_method_std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the per-token loss when ``labels`` are given.

        Args:
            input_ids: ``[B, S]`` int64 (or int32) token ids in ``[0, V)``.
            labels: None, or ``[B, S]`` int64 target ids; a label of -100 gives a loss of exactly 0
                (``F.cross_entropy``'s ignore_index).
            position_ids: None (positions ``0..S-1``), or ``[B, S]`` int64 RoPE positions in ``[0, S)``
                (Megatron's ``--reset-position-ids``: restarting at every document).
            document_ids: None (causal attention over the whole row), or ``[B, S]`` int64: a token attends only
                to earlier tokens of the same id (Megatron's ``--reset-attention-mask``;
                ``document_mask.document_causal_mask``, built once per forward). A row of several documents then
                gives each document the logits it has alone.
        Returns:
            ``[B, S, V]`` float32 logits when ``labels`` is None, else the per-token cross-entropy ``[B, S]``
            float32 in nats (Megatron's convention: the caller reduces it), a tensor of its own rather than a
            view, so the caller may mask it in place. The output matmul runs in the autocast / parameter dtype
            and its result is upcast before the softmax (Megatron and Hugging Face do the same: an fp32 matmul
            over the vocabulary would cost as much as several layers); with ``cross_entropy_chunk_size`` the
            loss never holds the ``[B * S, V]`` logits at once (``chunked_cross_entropy``). Under TP every rank
            of the TP group returns the same tensor; the gradient reaching it flows back only through the
            rank's own tokens.
        Raises:
            TypeError: ``input_ids`` is not an int64 / int32 tensor, or ``labels``, ``position_ids`` or
                ``document_ids`` not an int64 one.
            ValueError: ``input_ids`` is not 2-D, ``labels``, ``position_ids`` or ``document_ids`` has another
                shape, under TP S is not a multiple of the TP size, or (CPU tensors, outside torch.compile) an id
                of ``input_ids`` is outside ``[0, V)``, a label outside ``[0, V)`` and not -100, or a position
                outside ``[0, S)``. CUDA ids are not checked here, as that would cost a host sync per forward:
                an id out of range trips the embedding's or the loss's device-side assert (the trainer checks
                the tokenizer's ids against V at start-up).
        """
        vocab_size = self.config.vocab_size
        _check_ids("input_ids", input_ids, (torch.int64, torch.int32), vocab_size)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, S], got shape {tuple(input_ids.shape)}")
        if labels is not None:
            _check_ids("labels", labels, (torch.int64,), vocab_size, ignore_index=-100)
        if position_ids is not None:
            _check_ids("position_ids", position_ids, (torch.int64,), input_ids.shape[1], what="positions")
        if document_ids is not None:
            _check_ids("document_ids", document_ids, (torch.int64,), None)
        for name, ids in (("labels", labels), ("position_ids", position_ids), ("document_ids", document_ids)):
            if ids is not None and ids.shape != input_ids.shape:
                raise ValueError(f"{name}: expected shape {tuple(input_ids.shape)}, got {tuple(ids.shape)}")
        tp = 1 if self.tp_mesh is None else self.tp_mesh.size()
        if input_ids.shape[1] % tp:
            raise ValueError(f"input_ids: sequence length {input_ids.shape[1]} must be a multiple of the TP size {tp}")
        mask = None if document_ids is None else document_causal_mask(document_ids)
        hidden_BSH = self.decoder(self.embedding(input_ids), position_ids, mask)  # under TP: [B, S / tp, H]
        weight = tp_full(self.embedding.weight if self.output_layer is None else self.output_layer.weight)
        if labels is None:
            return self._gather_sequence(F.linear(hidden_BSH, weight).float())
        if tp > 1:
            labels = labels.chunk(tp, dim=1)[self.tp_mesh.get_local_rank()]
        loss_T = chunked_cross_entropy(hidden_BSH.flatten(0, 1), weight, labels.flatten(),
                                       self.config.cross_entropy_chunk_size)
        # A fresh [B, S] tensor, not a view of loss_T: FSDP2 hooks its backward on the module's outputs, and an
        # in-place op on a returned view (a caller's `loss[mask] = 0`) would drop that hook.
        return self._gather_sequence(loss_T.view(labels.shape)).clone()

    def _gather_sequence(self, local_BS: torch.Tensor) -> torch.Tensor:
        """Under TP, ``[B, S / tp, ...]`` of every TP rank -> ``[B, S, ...]`` on each (all-gather); backward
        keeps this rank's slice of the gradient (every rank's gradient is the same, so no collective)."""
        if self.tp_mesh is None:
            return local_BS
        return DTensor.from_local(local_BS, self.tp_mesh, [Shard(1)], run_check=False).full_tensor()

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in depth order (``.router`` holds expert bias, ``aux_loss_scale`` and the routing record)."""
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def num_parameters(self, active: bool = False) -> int:
        """Parameters held by this module, each shared one once (a tied embedding counts once).

        ``active=True``: the parameters one token uses. Routed experts count ``moe_router_topk`` experts' worth
        (``topk / num_local_experts`` of the experts held); everything else counts fully, the input embedding
        included, as in the published figures (Qwen3-30B-A3B's 3.3B, Mixtral's 12.9B, OLMoE's 1.3B all include
        both embedding matrices: ``tests/models/test_configs.py`` checks them). Under EP the total counts this
        rank's experts only; the active count is the same on every rank.
        """
        count = sum(p.numel() for p in self.parameters())
        if not active:
            return count
        for layer in self.moe_layers():
            # L experts of equal size: the topk-expert share is exact in integers.
            routed = sum(p.numel() for p in layer.experts.parameters())
            count -= routed - routed * self.config.moe_router_topk // layer.num_local_experts
        return count

    def flops_per_token(self) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_length``: ``6 P + 12 num_layers Nq D S``.

        ``P``: the active parameters less the input embedding (a lookup, no FLOPs; a tied one is still the
        output matmul and stays in). Each is one multiply-add per token forward and two backward: 6 FLOPs.
        Norm weights and biases are counted as if they were matmul weights (< 0.01% of any config here).
        ``12 num_layers Nq D S``: attention's ``Q K^T`` and ``A V``, forward and backward, without the causal half
        saving. Source: PaLM (Chowdhery et al. 2022), appendix B, the formula MFU is usually quoted with;
        Megatron-LM's ``num_floating_point_operations`` (Narayanan et al. 2021, appendix) builds the same terms
        from the config, without the router and norms.
        """
        cfg = self.config
        matmul_params = self.num_parameters(active=True)
        if self.output_layer is not None:
            matmul_params -= self.embedding.weight.numel()
        attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels * cfg.seq_length
        return float(6 * matmul_params + attention)


def _check_ids(name: str, ids: torch.Tensor, dtypes: tuple[torch.dtype, ...], vocab_size: int | None,
               ignore_index: int | None = None, what: str = "token ids") -> None:
    """``ids``' dtype, and on the CPU outside compilation (no host sync) that each id is in ``[0, vocab_size)``
    or ``ignore_index`` (``vocab_size`` None: any id; ``what`` names the values, a bound other than the
    vocabulary's is a sequence length)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in dtypes:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{name}: expected a tensor of {' or '.join(map(str, dtypes))}, got {got}")
    if vocab_size is None or ids.device.type != "cpu" or torch.compiler.is_compiling():
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bad.any():
        allowed = f"[0, {vocab_size})" + (f" (vocab_size {vocab_size})" if what == "token ids" else "")
        if ignore_index is not None:
            allowed += f" or {ignore_index}"
        raise ValueError(f"{name}: expected {what} in {allowed}, got {ids[bad][0].item()}")


__all__ = ["GPTModel"]
