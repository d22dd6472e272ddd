"""Plain Keras models, from the same `cfg.model` fields as the PyTorch ones (`trainers/models/`), the builders of
the built-in specs (specs.py).

`keras` is passed in (the tf_mwms backend uses tf-keras, see `trainers/tf/adapter.py`); the code runs unchanged
on Keras 3. Images and numeric features: normalised floats [B, width] -> logits [B, classes]; tokens: ids [B, T]
with [PAD] = 0.
The logits layer is float32 under any mixed-precision policy (`trainer.precision`), so the softmax and the loss
are computed in float32; under the default float32 policy this changes nothing.
"""
from __future__ import annotations

import functools
from typing import Any

from contract.data import DataSchema
from trainers.models.portable_init import mlp_weights


def build_embed_pool(keras: Any, cfg: Any, inputs: DataSchema, seed: int | None = None) -> Any:
    """`mask_zero` keeps padding out of the mean, as trainers/models/text.py does."""
    layers = keras.layers
    return keras.Sequential([
        layers.Input(shape=(inputs.max_len,), dtype="int32"),
        layers.Embedding(inputs.vocab_size, cfg.embed_dim, mask_zero=True),
        layers.GlobalAveragePooling1D(),  # masked mean over real tokens
        layers.Dropout(cfg.dropout),
        layers.Dense(cfg.hidden, activation="relu"), layers.Dropout(cfg.dropout),
        layers.Dense(inputs.target.outputs, dtype="float32"),
    ], name="embed_pool")


def build_tfidf(keras: Any, cfg: Any, inputs: DataSchema, seed: int | None = None) -> Any:
    """The twin of trainers/models/tf_modules.py's, which tf_dtensor trains: the logged model."""
    from trainers.models.tf_modules import BN_EPSILON, BN_MOMENTUM

    layers = keras.layers
    return keras.Sequential([
        layers.Input(shape=(inputs.max_len,), dtype="int32"),
        token_features_layer(keras)(inputs.vocab_size, cfg.bigram_buckets),
        layers.Dense(cfg.hidden),
        layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=BN_EPSILON), layers.ReLU(),
        layers.Dropout(cfg.dropout),
        layers.Dense(inputs.target.outputs, dtype="float32"),
    ], name="tfidf")


def build_mlp(keras: Any, cfg: Any, inputs: DataSchema, seed: int | None = None) -> Any:
    """`seed`: initial weights `portable_init.mlp_weights` (PyTorch's MLP starts from the same ones)."""
    layers = keras.layers
    sizes = [inputs.features.width, *cfg.hidden, inputs.target.outputs]
    stack = [layers.Input(shape=(sizes[0],))]
    for size in cfg.hidden:
        stack += [layers.Dense(size, activation="relu"), layers.Dropout(cfg.dropout)]
    model = keras.Sequential([*stack, layers.Dense(sizes[-1], dtype="float32")], name="mlp")
    if seed is not None:
        model.set_weights(mlp_weights(sizes, seed))
    return model


def build_cnn(keras: Any, cfg: Any, inputs: DataSchema, seed: int | None = None) -> Any:
    layers = keras.layers
    shape = inputs.features.shape
    c1, c2 = cfg.channels
    return keras.Sequential([
        layers.Input(shape=(inputs.features.width,)),
        layers.Reshape((*shape[:2], shape[2] if len(shape) == 3 else 1)),  # channels last
        layers.Conv2D(c1, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),  # (B, H/2, W/2, c1)
        layers.Conv2D(c2, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),  # (B, H/4, W/4, c2)
        layers.Flatten(), layers.Dropout(cfg.dropout),
        layers.Dense(cfg.hidden, activation="relu"), layers.Dropout(cfg.dropout),
        layers.Dense(inputs.target.outputs, dtype="float32"),
    ], name="cnn")


@functools.cache
def token_features_layer(keras: Any) -> type:
    """`TokenFeatures` on this Keras' base class: token ids [B, T] -> the TF-IDF vectors tf_dtensor trains on
    (`tf_modules.tfidf_features`), the IDF a weight of the layer (set from the checkpoint)."""

    class TokenFeatures(keras.layers.Layer):
        def __init__(self, vocab_size: int, bigram_buckets: int, **kwargs: Any):
            super().__init__(**kwargs)
            self.vocab_size, self.bigram_buckets = vocab_size, bigram_buckets

        def build(self, input_shape: Any) -> None:
            self.idf = self.add_weight(name="idf", shape=(self.vocab_size + self.bigram_buckets,), trainable=False,
                                       initializer="zeros")

        def call(self, ids):
            """Token ids [B, T] -> TF-IDF vectors. Not annotated: AutoGraph converts `call` by running its `def`
            again in the method's globals, and a logged model brings this class to a scoring process by value
            (MLflow cloudpickles Keras' custom objects) with only the globals its code uses: neither `Any` nor the
            `annotations` future import that keeps annotations unevaluated. An annotation naming anything but a
            builtin fails the conversion there ("AutoGraph could not transform ... name 'Any' is not defined")."""
            from trainers.models.tf_modules import tfidf_features

            return tfidf_features(ids, self.idf, self.bigram_buckets)

        def get_config(self) -> dict:
            return {**super().get_config(), "vocab_size": self.vocab_size, "bigram_buckets": self.bigram_buckets}

    return TokenFeatures


def custom_objects(keras: Any) -> dict[str, type]:
    """The layers of ours a saved Keras model may hold: MLflow stores them with the model and hands them back when
    it loads it."""
    return {"TokenFeatures": token_features_layer(keras)}
