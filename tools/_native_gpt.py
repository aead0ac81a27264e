"""A plain-PyTorch MoE GPT and its training step: the peer trainer tools/bench_pretrain.py measures moe_core's
against.

Legend: B batch, S sequence, H hidden, N heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _native_moe import NativeMoE
from torch import nn


def rope_cos_sin(seq: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[S, D]`` float32 of the rotate-half RoPE (Su et al. 2021): pair j turns at
    ``base^(-2j/D)``, dimensions j and j + D/2 form pair j."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x_BNSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float32, returned in x's dtype."""
    x = x_BNSD.float()
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-second, first], dim=-1) * sin).to(x_BNSD.dtype)


class Attention(nn.Module):
    """Multi-head causal self-attention: one qkv linear (q, k, v rows in that order), RoPE, SDPA, out linear."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x_BSH.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(x_BSH).chunk(3, dim=-1))
        out_BNSD = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.proj(out_BNSD.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    """Pre-norm ``x + attention(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, hidden: int, heads: int, eps: float, moe: NativeMoE):
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden, eps=eps)
        self.attention = Attention(hidden, heads)
        self.moe_norm = nn.RMSNorm(hidden, eps=eps)
        self.moe = moe

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attention(self.attention_norm(x_BSH), cos, sin)
        return x_BSH + self.moe(self.moe_norm(x_BSH))


def _qkv_sections(attn: nn.Module) -> torch.Tensor:
    """A moe_core ``SelfAttention``'s ``linear_qkv`` weight (MHA: each head's q, k and v rows in turn,
    Megatron's layout) as ``[q; k; v]`` rows."""
    weight = attn.linear_qkv.weight
    return weight.view(attn.num_heads, 3, attn.head_dim, -1).transpose(0, 1).reshape(weight.shape)


class NativeGPT(nn.Module):
    """Embedding -> MoE blocks -> RMSNorm -> untied output linear; ``forward(ids, labels)`` is the mean
    cross-entropy (logits upcast to float32).

    Build it with ``from_gpt``: the function of a moe_core ``GPTModel`` with MHA, no QK-norm, no bias, an
    untied output layer and a ``NativeMoE``-compatible MoE in every layer.
    """

    def __init__(self, vocab: int, hidden: int, heads: int, eps: float, rotary_base: float, moes: list[NativeMoE]):
        super().__init__()
        self.heads, self.rotary_base = heads, rotary_base
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, eps, moe) for moe in moes)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.output = nn.Linear(hidden, vocab, bias=False)

    @classmethod
    @torch.no_grad()
    def from_gpt(cls, gpt: nn.Module) -> NativeGPT:
        """Copies of a moe_core ``GPTModel``'s weights, on its device.

        Raises:
            ValueError: the model has GQA, QK-norm, biases, tied embeddings or a dense layer.
        """
        cfg = gpt.config
        layers = gpt.decoder.layers
        bad = [name for name, is_bad in {
            "num_query_groups": cfg.num_query_groups != cfg.num_attention_heads,
            "kv_channels": cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size,
            "qk_layernorm": cfg.qk_layernorm, "add_bias_linear": cfg.add_bias_linear,
            "share_embeddings_and_output_weights": cfg.share_embeddings_and_output_weights,
            "moe_layer_freq": not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)),
        }.items() if is_bad]
        if bad:
            raise ValueError(f"gpt.config: NativeGPT has MHA, no QK-norm, no bias, untied output and MoE in every "
                             f"layer; these fields differ: {bad}")
        moes = [NativeMoE.from_moe_layer(layer.mlp) for layer in layers]
        moes = [NativeMoE(*(nn.Parameter(p.detach().clone()) for p in (m.router_weight, m.w1, m.w2)), m.topk)
                for m in moes]
        device = gpt.embedding.weight.device
        with torch.device(device):
            model = cls(cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.layernorm_epsilon,
                        cfg.rotary_base, moes)
        model.embedding.weight.copy_(gpt.embedding.weight)
        model.output.weight.copy_(gpt.output_layer.weight)
        model.norm.weight.copy_(gpt.decoder.final_layernorm.weight)
        for block, layer in zip(model.layers, layers, strict=True):
            block.attention_norm.weight.copy_(layer.input_layernorm.weight)
            block.attention.qkv.weight.copy_(_qkv_sections(layer.self_attention))
            block.attention.proj.weight.copy_(layer.self_attention.linear_proj.weight)
            block.moe_norm.weight.copy_(layer.pre_mlp_layernorm.weight)
        return model.to(gpt.embedding.weight.dtype)

    def hidden(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[B, S]`` int64 -> the final RMSNorm's output ``[B, S, H]``."""
        x_BSH = self.embedding(ids_BS)
        cos, sin = rope_cos_sin(ids_BS.shape[1], x_BSH.shape[-1] // self.heads, self.rotary_base, ids_BS.device)
        for block in self.layers:
            x_BSH = block(x_BSH, cos, sin)
        return self.norm(x_BSH)

    def forward(self, ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """``ids``, ``labels`` ``[B, S]`` int64 -> the mean loss over the B * S tokens, a 0-dim float32 tensor."""
        logits_BSV = self.output(self.hidden(ids_BS)).float()
        return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten())


def build_adamw(model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
                ) -> torch.optim.AdamW:
    """AdamW with weight decay on the 2-D+ weights only, fused when the parameters are on CUDA."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def train_step(model: NativeGPT, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor,
               micro_batch_size: int, max_norm: float, bf16: bool) -> torch.Tensor:
    """Forward and backward over the micro-batches of ``inputs`` / ``labels`` ``[M * micro_batch_size, S]``
    (bf16 autocast on CUDA when ``bf16``), gradient clipping to ``max_norm``, AdamW step. Returns the mean
    loss, a 0-dim tensor (no host sync)."""
    device = model.embedding.weight.device
    micro = list(zip(inputs.split(micro_batch_size), labels.split(micro_batch_size), strict=True))
    step_loss = torch.zeros((), device=device)
    for micro_inputs, micro_labels in micro:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and device.type == "cuda"):
            loss = model(micro_inputs.to(device), micro_labels.to(device)) / len(micro)
        loss.backward()
        step_loss += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


__all__ = ["NativeGPT", "build_adamw", "train_step", "rope_cos_sin", "rotate"]
