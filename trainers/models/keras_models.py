"""MNIST classifiers as plain Keras models, from the same `cfg.model` fields as `trainers/models/mnist.py`.

`keras` is passed in (the tf_mwms backend uses tf-keras, see `trainers/tf_mwms.py`); the code runs unchanged
on Keras 3. Inputs are normalised float images [B, 784]; outputs are logits [B, 10].
"""
from __future__ import annotations

from typing import Any


def build_keras_model(model_cfg: Any, keras: Any, classes: int = 10) -> Any:
    layers = keras.layers
    if model_cfg.name == "mlp":
        stack = [layers.Input(shape=(784,))]
        for size in model_cfg.hidden:
            stack += [layers.Dense(size, activation="relu"), layers.Dropout(model_cfg.dropout)]
        return keras.Sequential([*stack, layers.Dense(classes)], name="mlp")
    if model_cfg.name == "cnn":
        c1, c2 = model_cfg.channels
        return keras.Sequential([
            layers.Input(shape=(784,)),
            layers.Reshape((28, 28, 1)),
            layers.Conv2D(c1, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),  # (B, 14, 14, c1)
            layers.Conv2D(c2, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),  # (B, 7, 7, c2)
            layers.Flatten(), layers.Dropout(model_cfg.dropout),
            layers.Dense(model_cfg.hidden, activation="relu"), layers.Dropout(model_cfg.dropout),
            layers.Dense(classes),
        ], name="cnn")
    raise ValueError(f"no Keras model for '{model_cfg.name}' (choices: mlp, cnn)")
