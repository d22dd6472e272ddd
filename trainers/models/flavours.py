"""Named model sizes, without a framework: the config checks read them before any worker (or torch) starts."""
from __future__ import annotations

# BERT-style encoder: name -> (layers, hidden, heads)
BERT_FLAVOURS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "small": (4, 256, 4),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}
