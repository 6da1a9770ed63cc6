"""A tiny causal transformer for packed token blocks (torch only, small enough for a CPU).

Attention is causal *and* block-diagonal over the documents of a packed block
(``doc_ids``), positions restart at every document, and the loss skips padding and the
first token of each document (nothing of its own document precedes it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[b, 1, L, L]`` boolean: position i may attend to j <= i of the same document."""
    length = doc_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each position's offset from the start of its document segment in the block."""
    length = doc_ids.shape[1]
    index = torch.arange(length, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(att.transpose(1, 2).reshape(b, length, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token + per-document position embeddings, ``layers`` pre-norm blocks, tied head."""

    def __init__(self, vocab: int, block_len: int, *, d_model: int = 64, heads: int = 4,
                 layers: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(block_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        for emb in (self.tokens, self.positions):  # small: the head is tied to the tokens'
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) + self.positions(document_positions(doc_ids))
        mask = document_mask(doc_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x) @ self.tokens.weight.T


def lm_loss(model: nn.Module, input_ids: torch.Tensor, doc_ids: torch.Tensor,
            pad_id: int) -> torch.Tensor:
    """Next-token cross entropy within documents, padding left out."""
    logits = model(input_ids, doc_ids)[:, :-1]
    targets = input_ids[:, 1:]
    keep = (targets != pad_id) & (doc_ids[:, 1:] == doc_ids[:, :-1])
    if not keep.any():  # an all-padding batch still joins DDP's gradient all-reduce
        return logits.sum() * 0.0
    return F.cross_entropy(logits[keep], targets[keep])
