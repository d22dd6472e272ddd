"""A small text classifier: mean of the token embeddings (padding excluded), then an MLP. The baseline
next to BERT for IMDb, and the text model the Keras backends share (`keras_models.py` builds the same
shape)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from contract.data import PAD_ID, DataSchema


def trailing_padding_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T) bool, True up to each row's last id that is not [PAD] (id 0): the padding is at a row's
    end, and an id 0 inside the row (a real token in tokenizers that number one there) stays unmasked."""
    positions = torch.arange(1, input_ids.shape[1] + 1, device=input_ids.device)  # (T,)
    lengths = ((input_ids != PAD_ID) * positions).amax(dim=1, keepdim=True)  # (B, 1)
    return positions <= lengths


class EmbedPool(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, dropout: float, num_classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(embed_dim, hidden), nn.ReLU(),
                                  nn.Dropout(dropout), nn.Linear(hidden, num_classes))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T), attention_mask (B, T) with 1/True for real tokens (None: the non-[PAD] ids) -> logits
        (B, classes)."""
        if attention_mask is None:
            attention_mask = input_ids != PAD_ID
        mask = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)  # (B, T, 1)
        summed = (self.embed(input_ids) * mask).sum(dim=1)
        return self.head(summed / mask.sum(dim=1).clamp(min=1.0))


def build_embed_pool(cfg: Any, inputs: DataSchema, seed: int | None = None) -> EmbedPool:
    return EmbedPool(inputs.vocab_size, cfg.embed_dim, cfg.hidden, cfg.dropout, inputs.target.outputs)
