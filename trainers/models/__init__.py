"""Plain models (no parallelism inside), built from their registered spec (contract/registry.py; the built-in
ones in specs.py). This package is imported by TensorFlow workers too, so a framework is imported only where a
model of it is built."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from contract.augment import Augment
from contract.data import DataSchema
from contract.registry import MODELS, ModelSpec, Ref, resolve
from trainers.models import specs  # noqa: F401  (registers the built-in models)

if TYPE_CHECKING:
    from torch import nn


def _builder(model_cfg: Any, framework: str) -> Any:
    spec: ModelSpec = MODELS.get(model_cfg.name)
    ref = getattr(spec, framework)
    if ref is None:
        raise ValueError(f"model '{spec.name}' has no {framework} builder")
    return resolve(ref)


def build_model(model_cfg: Any, inputs: DataSchema, seed: int | None = None) -> nn.Module:
    """The PyTorch model of `model_cfg` for data of `inputs`. `seed`: models that take one (the MLP) draw their
    initial weights from it, the same in every framework; the others draw from torch's global generator (seeded
    by the caller)."""
    return _builder(model_cfg, "torch")(model_cfg, inputs, seed)


def has_builder(model_cfg: Any, framework: str) -> bool:
    """Whether the model's spec has a builder for `framework` (torch, keras, dtensor, lightning)."""
    return getattr(MODELS.get(model_cfg.name), framework) is not None


def augment_ref(cfg: Any) -> Ref | None:
    """What the model spec names as its augmentation of training batches when `data.augment`, else None."""
    return MODELS.get(cfg.model.name).augment if cfg.data.augment else None


def training_augment(cfg: Any) -> Augment | None:
    """The model spec's augmentation of training batches (contract/augment.py) when `data.augment`, else None."""
    ref = augment_ref(cfg)
    return None if ref is None else resolve(ref)


def build_lightning_module(model_cfg: Any, inputs: DataSchema, seed: int | None = None) -> Any:
    """The spec's own `lightning.pytorch.LightningModule` of `model_cfg` (trainer=lightning)."""
    return _builder(model_cfg, "lightning")(model_cfg, inputs, seed)


def build_keras_model(model_cfg: Any, keras: Any, inputs: DataSchema, seed: int | None = None) -> Any:
    """The (uncompiled) Keras model of `model_cfg`, built with `keras` (tf-keras in the TensorFlow backends)."""
    return _builder(model_cfg, "keras")(keras, model_cfg, inputs, seed)


def build_keras_twin(model_cfg: Any, keras: Any, inputs: DataSchema) -> Any:
    """The Keras model a tf_dtensor module is logged as: the spec's `keras_twin`, else its `keras` model."""
    spec: ModelSpec = MODELS.get(model_cfg.name)
    return resolve(spec.keras_twin or spec.keras)(keras, model_cfg, inputs, None)


def build_module(model_cfg: Any, inputs: DataSchema, seed: int) -> Any:
    """The `tf.Module` tf_dtensor lays out on its mesh."""
    return _builder(model_cfg, "dtensor")(model_cfg, inputs, seed)
