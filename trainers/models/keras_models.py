"""Plain Keras models, from the same `cfg.model` fields as the PyTorch ones (`trainers/models/`).

`keras` is passed in (the tf_mwms backend uses tf-keras, see `trainers/tf/mwms.py`); the code runs unchanged
on Keras 3. MNIST: normalised float images [B, 784] -> logits [B, 10]. IMDb (`embed_pool`): token ids [B, T]
with [PAD] = 0 -> logits [B, 2]; `mask_zero` keeps padding out of the mean, as `trainers/models/text.py` does.
The logits layer is float32 under any mixed-precision policy (`trainer.precision`), so the softmax and the loss
are computed in float32; under the default float32 policy this changes nothing.
"""
from __future__ import annotations

import functools
from typing import Any

from trainers.models.portable_init import mlp_weights


def build_keras_model(model_cfg: Any, keras: Any, model_inputs: dict | None = None, seed: int | None = None) -> Any:
    """`seed`: the MLP's initial weights are `portable_init.mlp_weights` (PyTorch's MLP starts from the same ones
    with that seed); the other models draw theirs from Keras' seeded generators."""
    layers = keras.layers
    if model_cfg.name == "embed_pool":
        return keras.Sequential([
            layers.Input(shape=(model_inputs["max_len"],), dtype="int32"),
            layers.Embedding(model_inputs["vocab_size"], model_cfg.embed_dim, mask_zero=True),
            layers.GlobalAveragePooling1D(),  # masked mean over real tokens
            layers.Dropout(model_cfg.dropout),
            layers.Dense(model_cfg.hidden, activation="relu"), layers.Dropout(model_cfg.dropout),
            layers.Dense(2, dtype="float32"),
        ], name="embed_pool")
    if model_cfg.name == "tfidf":  # the twin of trainers/models/tf_modules.py's, which tf_dtensor trains
        from trainers.models.tf_modules import BN_EPSILON, BN_MOMENTUM

        return keras.Sequential([
            layers.Input(shape=(model_inputs["max_len"],), dtype="int32"),
            token_features_layer(keras)(model_inputs["vocab_size"], model_cfg.bigram_buckets),
            layers.Dense(model_cfg.hidden),
            layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=BN_EPSILON), layers.ReLU(),
            layers.Dropout(model_cfg.dropout),
            layers.Dense(2, dtype="float32"),
        ], name="tfidf")
    classes = 10
    if model_cfg.name == "mlp":
        stack = [layers.Input(shape=(784,))]
        for size in model_cfg.hidden:
            stack += [layers.Dense(size, activation="relu"), layers.Dropout(model_cfg.dropout)]
        model = keras.Sequential([*stack, layers.Dense(classes, dtype="float32")], name="mlp")
        if seed is not None:
            model.set_weights(mlp_weights([784, *model_cfg.hidden, classes], seed))
        return model
    if model_cfg.name == "cnn":
        c1, c2 = model_cfg.channels
        return keras.Sequential([
            layers.Input(shape=(784,)),
            layers.Reshape((28, 28, 1)),
            layers.Conv2D(c1, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),  # (B, 14, 14, c1)
            layers.Conv2D(c2, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),  # (B, 7, 7, c2)
            layers.Flatten(), layers.Dropout(model_cfg.dropout),
            layers.Dense(model_cfg.hidden, activation="relu"), layers.Dropout(model_cfg.dropout),
            layers.Dense(classes, dtype="float32"),
        ], name="cnn")
    raise ValueError(f"no Keras model for '{model_cfg.name}' (choices: mlp, cnn, embed_pool, tfidf)")


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

        def call(self, ids: Any) -> Any:
            from trainers.models.tf_modules import tfidf_features

            return tfidf_features(ids, self.idf, self.bigram_buckets)

        def get_config(self) -> dict:
            return {**super().get_config(), "vocab_size": self.vocab_size, "bigram_buckets": self.bigram_buckets}

    return TokenFeatures


def custom_objects(keras: Any) -> dict[str, type]:
    """The layers of ours a saved Keras model may hold: MLflow stores them with the model and hands them back when
    it loads it."""
    return {"TokenFeatures": token_features_layer(keras)}
