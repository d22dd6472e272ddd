"""Plain `tf.Module` classifiers for `trainer=tf_dtensor`, no parallelism inside (trainers/tf/dtensor/mesh.py
turns their variables into DTensor variables with a layout each), written like the TensorFlow DTensor tutorial's:
Dense layers with ReLU between them, and a BatchNorm after the first one for the TF-IDF model.

- `mlp`: normalised features [B, width] -> logits [B, classes], the same layers and initial weights as the Keras and
  PyTorch MLPs (`portable_init`), so the loss-parity gate holds it to DDP's curve.
- `tfidf` (token data): a review's TF-IDF vector [B, vocab (+ bigram buckets)] (`tfidf_features`: sublinear counts of
  its tokens, and optionally of its hashed token pairs, times the inverse document frequency of each in the train
  split, scaled to unit length) -> Dense -> BatchNorm -> ReLU -> Dense -> logits [B, classes].

The logged model is a Keras twin (trainers/models/keras_models.py) that loads without a mesh: it computes the same
features from token ids in a layer of its own, with the IDF as that layer's weights (`keras_weights`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from contract.data import DataSchema
from trainers.models.portable_init import mlp_weights

# BatchNorm's moving averages: momentum 0.9, not Keras' 0.99: an IMDb epoch is ~88 steps of 256 rows, after which
# 0.99 still keeps 42% of the initial mean 0 and variance 1 (the hidden units' real variance is far smaller), so
# evaluation would normalise differently from training and score lower in the first epochs (benchmarks/README.md,
# IMDb).
BN_MOMENTUM, BN_EPSILON = 0.9, 1e-3
FEATURE_CHUNK = 64  # rows counted at once (a [rows, vocab + buckets] table)
SPECIAL_TOKENS = 5  # ids 0-4: [PAD] [UNK] [CLS] [SEP] [MASK] (pipelines/data/tokenize.py)
BIGRAM_HASH = 1_000_003  # a prime: bigram (a, b) goes to bucket (a * BIGRAM_HASH + b) % buckets


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


def build_mlp(cfg: Any, inputs: DataSchema, seed: int) -> Classifier:
    """The MLP of the PyTorch and Keras builders, with the same initial weights for one seed."""
    return Classifier([inputs.features.width, *cfg.hidden, inputs.target.outputs], cfg.dropout, seed, name="mlp")


def build_tfidf(cfg: Any, inputs: DataSchema, seed: int) -> Classifier:
    """On TF-IDF vectors of the vocabulary (and the bigram buckets): trainers/tf/dtensor computes them."""
    return Classifier([inputs.vocab_size + cfg.bigram_buckets, cfg.hidden, inputs.target.outputs], cfg.dropout,
                      seed, batch_norm=True, name="tfidf")


def token_counts(ids: Any, vocab_size: int, bigram_buckets: int, binary: bool = False) -> tf.Tensor:
    """float32 [B, vocab + buckets]: for each row of token ids [B, T], how often each token occurs, then each pair
    of consecutive tokens, hashed into `bigram_buckets` buckets (0: no bigrams); `binary`: 1 if it occurs at all.
    Special tokens count toward no bigram (their unigram columns get no weight: `inverse_document_frequency`)."""
    ids = tf.cast(ids, tf.int64)
    unigrams = tf.math.bincount(ids, minlength=vocab_size, maxlength=vocab_size, axis=-1, binary_output=binary,
                                dtype=tf.float32)
    if not bigram_buckets:
        return unigrams
    first, second = ids[:, :-1], ids[:, 1:]
    words = (first >= SPECIAL_TOKENS) & (second >= SPECIAL_TOKENS)
    pairs = tf.where(words, (first * BIGRAM_HASH + second) % bigram_buckets, bigram_buckets)  # else: one bucket past
    bigrams = tf.math.bincount(pairs, minlength=bigram_buckets + 1, maxlength=bigram_buckets + 1, axis=-1,
                               binary_output=binary, dtype=tf.float32)[:, :bigram_buckets]  # ... the end, dropped
    return tf.concat([unigrams, bigrams], axis=1)


def tfidf_features(ids: Any, idf: Any, bigram_buckets: int) -> tf.Tensor:
    """float32 [B, vocab + buckets]: a row's sublinear TF-IDF vector, log(1 + count) x IDF, scaled to unit length
    (long and short reviews alike)."""
    counts = token_counts(ids, int(idf.shape[0]) - bigram_buckets, bigram_buckets)
    return tf.math.l2_normalize(tf.math.log1p(counts) * idf, axis=1)


def document_frequencies(ids: np.ndarray, vocab_size: int, bigram_buckets: int) -> np.ndarray:
    """float64 [vocab + buckets]: in how many rows of token ids [N, T] each term occurs."""
    df = np.zeros(vocab_size + bigram_buckets, np.float64)
    for start in range(0, len(ids), FEATURE_CHUNK):
        chunk = token_counts(ids[start:start + FEATURE_CHUNK], vocab_size, bigram_buckets, binary=True)
        df += tf.reduce_sum(chunk, axis=0).numpy()
    return df


def inverse_document_frequency(df: np.ndarray, documents: float) -> np.ndarray:
    """float32: Keras TextVectorization's `log(1 + N / (1 + df))`; 0 for the special tokens ([PAD], [CLS], ...:
    ids below SPECIAL_TOKENS), which say nothing about a review."""
    idf = np.log1p(documents / (1.0 + df)).astype(np.float32)
    idf[:SPECIAL_TOKENS] = 0.0
    return idf


def keras_weights(weights: list[np.ndarray], idf: np.ndarray | None) -> list[np.ndarray]:
    """The Keras twin's weights from the module's (`Classifier.weights` order): the TF-IDF model's twin computes
    the features itself, from its IDF weights."""
    return list(weights) if idf is None else [idf, *weights]
