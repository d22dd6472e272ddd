"""A plain BERT-style encoder classifier (pre-LN), with no parallelism inside.

Tensor parallelism lives in `trainers.torch.parallel`; it shards q/k/v output features by whole heads, and this model
still works because attention reads its local head count from tensor shapes instead of the config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contract.data import PAD_ID, DataSchema
from trainers.models.flavours import BERT_FLAVOURS


@dataclass
class BertConfig:
    vocab_size: int  # token ids are in [0, vocab_size)
    max_len: int  # longest sequence the learned position table covers
    hidden: int  # model width; must be a multiple of `heads`
    layers: int  # number of encoder blocks
    heads: int  # attention heads; head_dim = hidden // heads
    mlp_ratio: int = 4  # MLP inner width = mlp_ratio * hidden
    dropout: float = 0.1  # embedding, residual and MLP dropout
    # On the attention probabilities. Off by default, as in nanoGPT and TorchTitan: with it, torch's CPU
    # attention leaves its fused kernel, a much slower step, and IMDb accuracy does not depend on it
    # (benchmarks/README.md, attention_dropout.py).
    attention_dropout: float = 0.0
    num_classes: int = 2  # classifier outputs
    pad_id: int = 0  # informational: the caller builds attention_mask from it (see `padding_mask`)

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")


def bert_config(flavour: str, vocab_size: int, max_len: int, **overrides: Any) -> BertConfig:
    """A named flavour's shape; any BertConfig field can be overridden (e.g. dropout=0.0)."""
    if flavour not in BERT_FLAVOURS:
        raise ValueError(f"unknown BERT flavour {flavour!r}; choose from {sorted(BERT_FLAVOURS)}")
    layers, hidden, heads = BERT_FLAVOURS[flavour]
    fields = {"layers": layers, "hidden": hidden, "heads": heads, **overrides}
    return BertConfig(vocab_size=vocab_size, max_len=max_len, **fields)


def padding_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) long mask, 1 = token, 0 = pad."""
    return (input_ids != pad_id).long()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, head_dim: int,
           dropout_p: float) -> torch.Tensor:
    """Multi-head attention core on projected (B, T, nh*hd) tensors; returns (B, T, nh*hd).

    Shared by the dense and the tensor-parallel attention so the math lives in one place. The head count is read
    from the shapes, so a rank holding only some heads runs unchanged.
    """
    B, T, width = q.shape
    n_heads = width // head_dim  # local heads: all of them dense, heads/tp under tensor parallelism
    q = q.view(B, T, n_heads, head_dim).transpose(1, 2)  # (B, nh, T, hd)
    k = k.view(B, T, n_heads, head_dim).transpose(1, 2)  # (B, nh, T, hd)
    v = v.view(B, T, n_heads, head_dim).transpose(1, 2)  # (B, nh, T, hd)
    # A row with no tokens at all would softmax over nothing (NaN); let it attend everywhere instead, its output
    # is dropped by the masked pooling anyway.
    key_mask = key_mask | ~key_mask.any(dim=-1, keepdim=True)
    attn_mask = key_mask[:, None, None, :]  # (B, 1, 1, T): True = may attend to this key
    # sdpa scales by 1/sqrt(q.shape[-1]) = 1/sqrt(head_dim), not 1/sqrt(hidden).
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)  # (B, nh, T, hd)
    return y.transpose(1, 2).reshape(B, T, n_heads * head_dim)  # (B, T, nh*hd)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.head_dim = hidden // heads  # stored; the head count is inferred per call from shapes
        self.dropout = dropout
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, h), key_mask (B, T) bool with True = token -> (B, T, h)."""
        p = self.dropout if self.training else 0.0
        y = attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), key_mask, self.head_dim, p)
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, dropout: float = 0.0):
        super().__init__()
        self.fc_in = nn.Linear(hidden, inner)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(inner, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(self.act(self.fc_in(x))))  # (B, T, h) -> (B, T, 4h) -> (B, T, h)


class Block(nn.Module):
    """Pre-LN encoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.attention_dropout)
        self.drop = nn.Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.mlp_ratio * cfg.hidden, cfg.dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), key_mask))
        return x + self.mlp(self.ln2(x))


class BertClassifier(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.hidden)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # BERT's N(0, 0.02) keeps the residual stream small at the start; LayerNorm keeps its (1, 0) default.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) long, attention_mask (B, T) with 1 = token, 0 = pad -> (B, C). Without a mask the
        [PAD] ids are the padding, as Keras' `mask_zero` reads them (what a logged model's caller passes).

        A pipeline stage is this model with the parts other stages own removed (trainers/torch/parallel/pipeline.py):
        without embeddings (`tok_emb` None) it takes the previous stage's hidden states (B, T, h) in place of
        input_ids, with the mask given; without a classifier it returns its hidden states (B, T, h)."""
        T = input_ids.shape[1]
        if T > self.cfg.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len={self.cfg.max_len}")
        if attention_mask is None:
            attention_mask = input_ids != PAD_ID
        key_mask = attention_mask.bool()  # (B, T)
        x = self.embed(input_ids) if self.tok_emb is not None else input_ids  # (B, T, h)
        for block in self.blocks:
            x = block(x, key_mask)
        return self.head(x, key_mask) if self.classifier is not None else x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, h) token plus position embeddings."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        return self.emb_drop(self.tok_emb(input_ids) + self.pos_emb(positions))

    def head(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """(B, T, h) hidden states -> (B, C) logits from the masked mean over the tokens."""
        x = self.ln_f(x)  # (B, T, h)
        weights = key_mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        # Masked mean: padded positions contribute nothing; clamp avoids 0/0 on an all-pad row.
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # (B, h)
        return self.classifier(pooled)  # (B, C)


def build_bert(cfg: Any, inputs: DataSchema, seed: int | None = None) -> BertClassifier:
    """The flavour's shape with the config's overrides, sized to the data's vocabulary, length and outputs. Draws
    its weights from torch's global generator (seeded by the caller)."""
    overrides = {key: cfg[key] for key in ("hidden", "layers", "heads") if cfg[key] is not None}
    config = bert_config(cfg.flavour, vocab_size=inputs.vocab_size, max_len=inputs.max_len, dropout=cfg.dropout,
                         attention_dropout=cfg.attention_dropout, num_classes=inputs.target.outputs, **overrides)
    return BertClassifier(config)
