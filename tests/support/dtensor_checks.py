"""DTensor against plain TensorFlow, in one fresh process with 4 logical CPU devices (one DTensor client):

    python -m tests.support.dtensor_checks

For each mesh (4x1 batch, 1x4 model, 2x2) and model (the MLP with a column, a row and a replicated layer; the
TF-IDF model with its BatchNorm), 3 steps of our optimizer on the DTensor model against tf-keras' on the same model
with plain variables, the same batches, global-norm clipping on: AdamW with decay for the MLP, SGD with momentum for
the TF-IDF model (the gradient of its Dense bias before the BatchNorm is 0 but for float noise, which Adam's
normalisation would blow up into steps of the learning rate, different in every summation order). Also the bytes of
weights on one device, and the Keras twin (the logged model) against the module on token ids. Prints JSON on its last
line; tests/unit/test_dtensor.py asserts on it.
"""
from __future__ import annotations

import json
import tempfile

import numpy as np
import tensorflow as tf
import tf_keras as keras
from omegaconf import OmegaConf
from tensorflow.experimental import dtensor

from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from trainers.models import build_keras_twin, build_module
from trainers.models.keras_models import custom_objects
from trainers.models.tf_modules import BIGRAM_HASH, SPECIAL_TOKENS, document_frequencies, \
    inverse_document_frequency, keras_weights, tfidf_features
from trainers.tf.dtensor.layout import MeshDims
from trainers.tf.dtensor.mesh import DTensorMesh, device_bytes, parallelize_dtensor
from trainers.tf.recipe import TORCH_ADAM_EPSILON, VariableOptimizer

MESHES = [(4, 1), (1, 4), (2, 2)]
VOCAB, MAX_LEN, ROWS, STEPS, LR = 64, 12, 16, 3, 0.01
RECIPES = {"mlp": OmegaConf.create({"optimizer": "adamw", "momentum": 0.9, "weight_decay": 0.1, "grad_clip": 1.0}),
           "tfidf": OmegaConf.create({"optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.0, "grad_clip": 1.0})}
MODELS = {"mlp": OmegaConf.create({"name": "mlp", "hidden": [32, 16], "dropout": 0.0}),
          "tfidf": OmegaConf.create({"name": "tfidf", "hidden": 8, "dropout": 0.0, "bigram_buckets": 16})}
BUCKETS = MODELS["tfidf"].bigram_buckets
SCHEMAS = {"mlp": mnist_schema(), "tfidf": imdb_schema(VOCAB, MAX_LEN)}


def data(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(inputs [STEPS * ROWS, ...], labels, token ids, idf): MNIST-shaped floats, or TF-IDF of random token ids."""
    rng = np.random.default_rng(0)
    rows = STEPS * ROWS
    if name == "mlp":
        return rng.normal(size=(rows, 784)).astype(np.float32), rng.integers(0, 10, rows), None, None
    ids = rng.integers(1, VOCAB, (rows, MAX_LEN)).astype(np.int32)
    ids[:, MAX_LEN // 2:] *= rng.integers(0, 2, (rows, MAX_LEN - MAX_LEN // 2))  # some [PAD], id 0
    ids[:, 0] = 2  # [CLS]
    idf = inverse_document_frequency(document_frequencies(ids, VOCAB, BUCKETS), rows)
    return tfidf_features(ids, idf, BUCKETS).numpy(), rng.integers(0, 2, rows), ids, idf


def loss_of(model, x, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x, training=True)))


def reference(name: str) -> tuple[list[float], list[np.ndarray]]:
    """tf-keras' optimizer on the plain model."""
    x, y, _, _ = data(name)
    model = build_module(MODELS[name], SCHEMAS[name], seed=0)
    params = [v for v in model.weights() if v.trainable]
    recipe = RECIPES[name]
    if recipe.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=LR, momentum=recipe.momentum, global_clipnorm=recipe.grad_clip)
    else:
        optimizer = keras.optimizers.AdamW(learning_rate=LR, weight_decay=recipe.weight_decay,
                                           epsilon=TORCH_ADAM_EPSILON, global_clipnorm=recipe.grad_clip)
        optimizer.exclude_from_weight_decay(var_list=[v for v in params if v.shape.rank <= 1])
    losses = []
    for step in range(STEPS):
        rows = slice(step * ROWS, (step + 1) * ROWS)
        with tf.GradientTape() as tape:
            loss = loss_of(model, tf.constant(x[rows]), tf.constant(y[rows]))
        optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        losses.append(float(loss))
    return losses, [v.numpy() for v in model.weights()]


def on_mesh(mesh: DTensorMesh, name: str) -> tuple[list[float], list[np.ndarray], int]:
    """Our optimizer on the DTensor model: (losses, whole weights, weight bytes on one device)."""
    x, y, _, _ = data(name)
    model = parallelize_dtensor(build_module(MODELS[name], SCHEMAS[name], seed=0), mesh)
    params = [v for v in model.weights() if v.trainable]
    optimizer = VariableOptimizer(tf, RECIPES[name], params, mesh.zeros_like)

    @tf.function
    def step(x, y, lr, update):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        optimizer.apply(tape.gradient(loss, params), lr, update)
        return loss

    per_coord, losses = ROWS // mesh.dims.batch, []
    for i in range(STEPS):
        rows = slice(i * ROWS, (i + 1) * ROWS)
        loss = step(mesh.pack_batch(x[rows], per_coord), mesh.pack_batch(y[rows], per_coord), mesh.scalar(LR),
                    mesh.scalar(float(i + 1)))
        losses.append(float(dtensor.unpack(loss)[0].numpy()))
    return losses, [mesh.whole(v) for v in model.weights()], device_bytes(model.weights())


def features_gap() -> float:
    """Largest difference between `tfidf_features` and the TF-IDF vectors counted here token by token."""
    _, _, ids, idf = data("tfidf")
    expected = np.zeros((len(ids), VOCAB + BUCKETS))
    for row, tokens in enumerate(ids):
        for token in tokens:
            expected[row, token] += 1
        for first, second in zip(tokens[:-1], tokens[1:]):
            if first >= SPECIAL_TOKENS and second >= SPECIAL_TOKENS:
                expected[row, VOCAB + (int(first) * BIGRAM_HASH + int(second)) % BUCKETS] += 1
    expected = np.log1p(expected) * idf
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    return float(np.abs(tfidf_features(ids, idf, BUCKETS).numpy() - expected).max())


def twin_gap(folder: str) -> float:
    """Largest logit difference between the trained TF-IDF module and its Keras twin on token ids, the twin saved
    and loaded back as MLflow does (Keras format, our layer among the custom objects)."""
    _, _, ids, idf = data("tfidf")
    module = build_module(MODELS["tfidf"], imdb_schema(VOCAB, MAX_LEN), seed=3)
    module.norm.moving_mean.assign(np.linspace(-1, 1, 8).astype(np.float32))  # non-trivial statistics
    module.norm.moving_variance.assign(np.linspace(0.5, 2, 8).astype(np.float32))
    twin = build_keras_twin(MODELS["tfidf"], keras, imdb_schema(VOCAB, MAX_LEN))
    twin.set_weights(keras_weights([v.numpy() for v in module.weights()], idf))
    twin.save(f"{folder}/twin.keras")
    twin = keras.models.load_model(f"{folder}/twin.keras", custom_objects=custom_objects(keras))
    expected = module(tfidf_features(ids, idf, BUCKETS), training=False).numpy()
    return float(np.abs(twin(ids, training=False).numpy() - expected).max())


def main() -> None:
    # One client, 4 logical devices; meshes of every shape over them.
    first = DTensorMesh(MeshDims(*MESHES[0], clients=1, devices_per_client=4), client=0)
    meshes = [first] + [DTensorMesh(MeshDims(b, m, 1, 4), 0, initialize=False) for b, m in MESHES[1:]]
    with tempfile.TemporaryDirectory() as folder:
        out: dict = {"twin_gap": twin_gap(folder), "features_gap": features_gap(), "meshes": {}}
    for name in MODELS:
        losses, weights = reference(name)
        out[name] = {"total_bytes": sum(w.nbytes for w in weights), "shapes": [list(w.shape) for w in weights]}
        for mesh in meshes:
            got, whole, per_device = on_mesh(mesh, name)
            out["meshes"][f"{name} {mesh.dims.batch}x{mesh.dims.model}"] = {
                "loss_gap": float(np.max(np.abs(np.array(got) - losses))),
                "weight_gap": max(float(np.max(np.abs(a - b))) for a, b in zip(whole, weights)),
                "device_bytes": per_device}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
