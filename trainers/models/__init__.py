"""Plain models (no parallelism inside). `build_model(cfg.model)` picks one by name."""
from __future__ import annotations

from typing import Any

from torch import nn


def build_model(model_cfg: Any) -> nn.Module:
    from trainers.models.mnist import CNN, MLP

    if model_cfg.name == "mlp":
        return MLP(hidden=list(model_cfg.hidden), dropout=model_cfg.dropout)
    if model_cfg.name == "cnn":
        return CNN(channels=list(model_cfg.channels), hidden=model_cfg.hidden, dropout=model_cfg.dropout)
    raise ValueError(f"unknown model {model_cfg.name}")
