"""TensorFlow DTensor (`trainer=tf_dtensor`) against plain TensorFlow on 1-D batch, 1-D model and 2x2 meshes of
logical CPU devices (tests/support/dtensor_checks.py, in a fresh process: TF fixes its devices at its first op), and the
mesh arithmetic of trainers/tf/dtensor/layout.py. Loss parity with DDP and stop/resume on the shared loop:
tests/unit/test_loop_backends.py; a 2-worker Ray run: tests/integration/test_tf_dtensor.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import fresh_tf_process
from trainers.tf.dtensor.layout import COLUMN, REPLICATED, ROW, MeshDims, dense_plan, sharded_widths

pytestmark = pytest.mark.slow  # TensorFlow DTensor in a process of its own

# Which of each model's weights (tests/support/dtensor_checks.py, `Classifier.weights` order) the model dimension
# shards: the MLP's column-parallel first layer and row-parallel second kernel (its logits layer is replicated), the
# TF-IDF model's column-parallel layer, the BatchNorm after it and the row-parallel logits kernel.
SHARDED = {"mlp": [True, True, True, False, False, False], "tfidf": [True] * 7 + [False]}


@pytest.fixture(scope="module")
def checks():
    return fresh_tf_process("tests.support.dtensor_checks")


@pytest.mark.parametrize("mesh", ["4x1", "1x4", "2x2"])
@pytest.mark.parametrize("model", ["mlp", "tfidf"])
def test_sharded_training_matches_plain_tensorflow(checks, model, mesh):
    """Same losses and weights after 3 steps as plain TF. Tolerance: float32 sums split over devices in another
    order (measured: losses within 5e-7, weights within 5e-6 after AdamW, 3e-8 after SGD); a wrong layout, a
    missing all-reduce or a per-shard clipping norm is off by orders of magnitude more."""
    result = checks["meshes"][f"{model} {mesh}"]
    assert result["loss_gap"] <= 2e-6
    assert result["weight_gap"] <= 2e-5


@pytest.mark.parametrize("mesh", ["4x1", "1x4", "2x2"])
@pytest.mark.parametrize("model", ["mlp", "tfidf"])
def test_each_device_holds_its_share_of_the_sharded_weights(checks, model, mesh):
    """One device holds 1/model of every sharded weight and all of the replicated ones."""
    model_size = int(mesh.split("x")[1])
    sizes = [int(np.prod(shape)) * 4 for shape in checks[model]["shapes"]]
    sharded = sum(size for size, split in zip(sizes, SHARDED[model]) if split)
    assert checks[model]["total_bytes"] == sum(sizes)
    assert checks["meshes"][f"{model} {mesh}"]["device_bytes"] == sharded // model_size + sum(sizes) - sharded


def test_tfidf_features_count_tokens_and_pairs(checks):
    """Sublinear TF-IDF of tokens and hashed token pairs (no pair with a special token), unit length, against a count
    token by token (float32 rounding)."""
    assert checks["features_gap"] <= 1e-6


def test_the_logged_keras_twin_predicts_as_the_module(checks):
    """The TF-IDF model's logged form (token ids -> our feature layer -> Dense -> BatchNorm -> Dense), saved and
    loaded back, gives the module's logits on token ids (float32 rounding: measured 2.4e-7)."""
    assert checks["twin_gap"] <= 1e-5


def test_mesh_arithmetic():
    # A model group inside a worker: 2 workers x 4 devices as 4 x 2, each worker feeding 2 batch coordinates.
    inside = MeshDims(batch=4, model=2, clients=2, devices_per_client=4)
    assert (inside.problem(), inside.layout_name, inside.data_groups, inside.coords_per_client) == (None, "2d", 2, 2)
    assert inside.local_coords(1) == [0, 0, 1, 1]
    # A model group across workers: 4 workers x 1 device as 2 x 2, two workers reading each data shard.
    across = MeshDims(batch=2, model=2, clients=4, devices_per_client=1)
    assert (across.problem(), across.clients_per_group, across.data_groups, across.coords_per_client) == (None, 2, 2, 1)
    assert MeshDims(1, 4, 2, 2).layout_name == "model" and MeshDims(4, 1, 2, 2).layout_name == "data"
    assert "4 devices" in MeshDims(2, 2, 1, 2).problem()
    assert "model group" in MeshDims(2, 3, 3, 2).problem()
    assert dense_plan(3) == [COLUMN, ROW, REPLICATED] and dense_plan(2) == [COLUMN, ROW]
    assert sharded_widths([784, 512, 256, 10]) == [512] and sharded_widths([784, 32, 16, 8, 10]) == [32, 8]
