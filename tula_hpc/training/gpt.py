"""The built-in GPT (`model: gpt`): a decoder-only transformer as GPT-2 and nanoGPT build it, small enough for a
character model on two CPU cores and shaped by model.kwargs (layers, heads, width) up to GPT-2 small.

Pre-LayerNorm blocks, causal self-attention through torch's scaled_dot_product_attention (its fused kernels on a
GPU), a 4x GELU MLP, learned positions over the context (data.seq_len) and the output layer tied to the token
embedding. Initialised as GPT-2: normal(0, 0.02), the projections into the residual stream scaled by
1/sqrt(2 x layers) so that the stream's variance does not grow with depth. Built on the meta device as anywhere else.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # GPT-2's


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a token sees only itself and those before it."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.proj.residual = True  # scaled at initialisation: it writes into the residual stream

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            # Padding (attention_mask 0) is hidden from every query, on top of the causal mask; a token always sees
            # itself, so that a padded query's row is not empty (its softmax would be NaN).
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            itself = torch.eye(length, dtype=torch.bool, device=x.device)
            mask = causal & (attention_mask.bool()[:, None, None, :] | itself)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x)): pre-LayerNorm, as GPT-2."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm_attention = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.norm_mlp = nn.LayerNorm(width)
        down = nn.Linear(4 * width, width)
        down.residual = True
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), down, nn.Dropout(dropout))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norm_attention(x), attention_mask))
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size), T at most seq_len."""

    def __init__(self, vocab_size: int, seq_len: int, layers: int, heads: int, width: int, dropout: float):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}: each head takes width / heads")
        self.seq_len = seq_len
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # tied: one matrix reads tokens in and writes them out
        residual_std = INIT_STD / math.sqrt(2 * layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if getattr(module, "residual", False) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.seq_len:
            raise ValueError(
                f"a sequence of {length} tokens is longer than the model's context of {self.seq_len} "
                "(data.seq_len); allowed: at most data.seq_len tokens"
            )
        positions = torch.arange(length, device=input_ids.device)
        x = self.dropout(self.tokens(input_ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.head(self.norm(x))


def gpt(vocab_size: int, seq_len: int, layers: int = 4, heads: int = 4, width: int = 128, dropout: float = 0.0) -> GPT:
    """The `gpt` built-in: vocab_size and seq_len from the data set, the rest from model.kwargs."""
    return GPT(vocab_size, seq_len, layers, heads, width, dropout)
