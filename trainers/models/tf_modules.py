"""Plain `tf.Module` classifiers for `trainer=tf_dtensor`, no parallelism inside (trainers/parallel/dtensor_mesh.py
turns their variables into DTensor variables with a layout each), written like the TensorFlow DTensor tutorial's:
Dense layers with ReLU between them, and a BatchNorm after the first one for the TF-IDF model.

- `mlp` (MNIST): normalised images [B, 784] -> logits [B, 10], the same layers and initial weights as the Keras and
  PyTorch MLPs (`portable_init`), so the loss-parity gate holds it to DDP's curve.
- `tfidf` (IMDb): a review's TF-IDF vector [B, vocab] (`tfidf_features`: term counts of its token ids times the
  inverse document frequency of each term in the train split; [PAD] weighs 0) -> Dense -> BatchNorm -> ReLU ->
  Dense -> logits [B, 2].

The logged model is a Keras twin (trainers/models/keras_models.py) that loads without a mesh: `keras_weights`
gives its weights, the IDF folded into the first kernel (counts @ (idf * W) = (counts * idf) @ W).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from trainers.models.portable_init import mlp_weights

BN_MOMENTUM, BN_EPSILON = 0.99, 1e-3  # Keras BatchNormalization's defaults (its twin)
FEATURE_CHUNK = 1024  # rows counted at once (a [rows, vocab] table)


class Dense(tf.Module):
    def __init__(self, kernel: np.ndarray, bias: np.ndarray, name: str):
        super().__init__(name=name)
        self.kernel = tf.Variable(kernel, name="kernel")  # [in, out]
        self.bias = tf.Variable(bias, name="bias")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        return tf.matmul(x, self.kernel) + self.bias


class BatchNorm(tf.Module):
    """Normalises each feature over the (global) batch in training, and with the moving averages otherwise."""

    def __init__(self, width: int, name: str):
        super().__init__(name=name)
        self.gamma = tf.Variable(np.ones(width, np.float32), name="gamma")
        self.beta = tf.Variable(np.zeros(width, np.float32), name="beta")
        self.moving_mean = tf.Variable(np.zeros(width, np.float32), trainable=False, name="moving_mean")
        self.moving_variance = tf.Variable(np.ones(width, np.float32), trainable=False, name="moving_variance")

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        if training:
            mean, variance = tf.nn.moments(x, axes=[0])
            self.moving_mean.assign(self.moving_mean * BN_MOMENTUM + mean * (1 - BN_MOMENTUM))
            self.moving_variance.assign(self.moving_variance * BN_MOMENTUM + variance * (1 - BN_MOMENTUM))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        return tf.nn.batch_normalization(x, mean, variance, self.beta, self.gamma, BN_EPSILON)


class Classifier(tf.Module):
    """Dense layers of widths `sizes` (inputs first), ReLU and dropout between them; `batch_norm`: a BatchNorm
    after the first one."""

    def __init__(self, sizes: list[int], dropout: float, seed: int, batch_norm: bool = False, name: str = "classifier"):
        super().__init__(name=name)
        weights = mlp_weights(sizes, seed)
        self.dense = [Dense(weights[2 * i], weights[2 * i + 1], name=f"dense{i}") for i in range(len(sizes) - 1)]
        self.norm = BatchNorm(sizes[1], name="norm") if batch_norm else None
        self.dropout = dropout

    def layers(self) -> list[tf.Module]:
        """The layers in order (what a sharding plan walks)."""
        return [self.dense[0], *([self.norm] if self.norm else []), *self.dense[1:]]

    def weights(self) -> list[tf.Variable]:
        """Every variable, in the Keras twin's `get_weights` order."""
        return [v for layer in self.layers() for v in layer_variables(layer)]

    def __call__(self, x: tf.Tensor, training: bool = False, seed: tf.Tensor | None = None) -> tf.Tensor:
        """Logits; `seed` ([2] int32, per step) draws the dropout masks in training."""
        last = len(self.dense) - 1
        for i, layer in enumerate(self.dense):
            x = layer(x)
            if i == last:
                return x
            if i == 0 and self.norm is not None:
                x = self.norm(x, training)
            x = tf.nn.relu(x)
            if training and self.dropout > 0:
                x = tf.nn.experimental.stateless_dropout(x, self.dropout, seed=seed + i)
        return x


def layer_variables(layer: tf.Module) -> list[tf.Variable]:
    if isinstance(layer, BatchNorm):
        return [layer.gamma, layer.beta, layer.moving_mean, layer.moving_variance]
    return [layer.kernel, layer.bias]


def build_module(model_cfg: Any, model_inputs: dict, seed: int) -> Classifier:
    if model_cfg.name == "mlp":
        return Classifier([784, *model_cfg.hidden, 10], model_cfg.dropout, seed, name="mlp")
    if model_cfg.name == "tfidf":
        return Classifier([model_inputs["vocab_size"], model_cfg.hidden, 2], model_cfg.dropout, seed,
                          batch_norm=True, name="tfidf")
    raise ValueError(f"no tf.Module model for '{model_cfg.name}' (choices: mlp, tfidf)")


def document_frequencies(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """float64 [vocab]: in how many rows of token ids [N, T] each term occurs."""
    df = np.zeros(vocab_size, np.float64)
    for start in range(0, len(ids), FEATURE_CHUNK):
        df += (term_counts(ids[start:start + FEATURE_CHUNK], vocab_size) > 0).sum(axis=0)
    return df


def inverse_document_frequency(df: np.ndarray, documents: int) -> np.ndarray:
    """float32 [vocab]: Keras TextVectorization's `log(1 + N / (1 + df))`; 0 for [PAD] (id 0), which only pads."""
    idf = np.log1p(documents / (1.0 + df)).astype(np.float32)
    idf[0] = 0.0
    return idf


def term_counts(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """float32 [N, vocab]: occurrences of each term in each row of token ids [N, T]."""
    rows = np.repeat(np.arange(len(ids)), ids.shape[1]) * vocab_size
    flat = np.bincount(rows + ids.reshape(-1).astype(np.int64), minlength=len(ids) * vocab_size)
    return flat.reshape(len(ids), vocab_size).astype(np.float32)


def tfidf_features(ids: np.ndarray, idf: np.ndarray) -> np.ndarray:
    return term_counts(ids, len(idf)) * idf


def keras_weights(weights: list[np.ndarray], idf: np.ndarray | None) -> list[np.ndarray]:
    """The Keras twin's weights from the module's (`Classifier.weights` order): the TF-IDF model's twin counts
    terms, so the IDF goes into its first kernel."""
    if idf is None:
        return list(weights)
    return [idf[:, None] * weights[0], *weights[1:]]
