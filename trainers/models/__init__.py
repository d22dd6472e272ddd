"""Plain models (no parallelism inside). `build_model(cfg.model)` picks one by name. This package is imported by
TensorFlow workers too (keras_models), so torch is imported only where a PyTorch model is built."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def build_model(model_cfg: Any, model_inputs: dict | None = None, seed: int | None = None) -> nn.Module:
    """`model_inputs`: what the data dictates (vocab_size, max_len for text; see the dataset manifest). `seed`: the
    MLP's initial weights are those Keras starts from with that seed (`portable_init`); the other models draw
    theirs from torch's global generator (seeded by the caller)."""
    from trainers.models.mnist import CNN, MLP

    if model_cfg.name == "mlp":
        return MLP(hidden=list(model_cfg.hidden), dropout=model_cfg.dropout, init_seed=seed)
    if model_cfg.name == "cnn":
        return CNN(channels=list(model_cfg.channels), hidden=model_cfg.hidden, dropout=model_cfg.dropout)
    if model_cfg.name == "bert":
        from trainers.models.bert import BertClassifier, bert_config

        overrides = {k: model_cfg[k] for k in ("hidden", "layers", "heads") if model_cfg[k] is not None}
        config = bert_config(model_cfg.flavour, vocab_size=model_inputs["vocab_size"],
                             max_len=model_inputs["max_len"], dropout=model_cfg.dropout,
                             attention_dropout=model_cfg.attention_dropout, **overrides)
        return BertClassifier(config)
    if model_cfg.name == "embed_pool":
        from trainers.models.text import EmbedPool

        return EmbedPool(model_inputs["vocab_size"], model_cfg.embed_dim, model_cfg.hidden, model_cfg.dropout)
    raise ValueError(f"unknown model {model_cfg.name}")
