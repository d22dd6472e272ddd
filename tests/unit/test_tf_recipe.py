"""The training recipe on the TensorFlow side (trainers/tf/recipe.py, trainers/tf/tf_mwms.py), measured in one fresh
process (tests/support/tf_recipe_checks.py: MirroredStrategy over two logical CPU devices). The recipe inside whole runs
(stop/resume, accumulation against the larger batch, bf16): tests/unit/test_loop_backends.py."""
from __future__ import annotations

import numpy as np
import pytest

from contract.recipe import lr_factor
from tests.conftest import fresh_tf_process
from tests.support.tf_recipe_checks import SCHEDULES

pytestmark = pytest.mark.slow  # TensorFlow in a process of its own

# Weights of |w| < 0.5 (these) are float32 to within 3e-8: a few roundings apart at most.
DELTA_ATOL = 1e-7


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return fresh_tf_process("tests.support.tf_recipe_checks", str(tmp_path_factory.mktemp("tf_recipe")))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_learning_rate_follows_the_recipe_curve(measured, schedule):
    """Update k of the optimizer applies lr * lr_factor(k) over 2 epochs of 5 batches with grad_accum=2
    (3 updates per epoch, the last one short: 6 in all), warmup included, clamped at 0 past the end. float32."""
    expected = [0.1 * lr_factor(k, schedule, SCHEDULES[schedule], 6) for k in range(8)]
    np.testing.assert_allclose(measured["lr"][schedule], expected, rtol=1e-6, atol=1e-9)


def test_adamw_decays_matrices_not_biases(measured):
    """AdamW, lr 0.1, weight_decay 0.1, zero gradients: kernels shrink by lr * wd, biases (ndim 1) not at all."""
    np.testing.assert_allclose(measured["decay"]["ndim2"], 0.01, rtol=1e-5)
    assert measured["decay"]["ndim1"] == [0.0, 0.0]


def test_accumulated_clipped_steps_in_both_loops(measured):
    """SGD (lr 0.5, no momentum), clip 1e-3, grad_accum=2, an epoch of 3 batches on 2 replicas: the weights move
    only after batch 2 and at the epoch's end (the short group), by exactly lr * 1e-3 each time (unclipped, the
    gradient norm is ~20): the norm clipped is the global one of the accumulated, all-reduced gradient. Clipping
    each replica's sum before the all-reduce would give another norm. Keras `fit` ends on the same weights. An
    epoch of 5 batches given in calls of 1 and 4 (a group completed across calls, a whole group compiled in one
    call, a group left open for the epoch's end) ends on the weights of the same epoch batch by batch."""
    steps = measured["steps"]
    moved = np.array(steps["moved"])
    assert list(moved > 0) == [False, True, False, True]
    np.testing.assert_allclose(moved[[1, 3]], 0.5 * 1e-3, rtol=1e-4)
    assert steps["iterations"] == [2, 2, 3, 3]
    np.testing.assert_allclose(steps["fit"], steps["custom"], rtol=0, atol=DELTA_ATOL)
    assert not np.allclose(steps["by_batch"], steps["custom"])  # two more batches moved it
    np.testing.assert_allclose(steps["in_calls"], steps["by_batch"], rtol=0, atol=DELTA_ATOL)


@pytest.mark.parametrize("loop", ["custom", "fit"])
def test_rank0_profiles_two_steps_after_a_warmup_step(measured, loop):
    """`trainer.profile_steps=2` on the TF backends: rank 0's profile holds an XPlane trace of exactly two training
    steps (each all-reduces its packed gradients once per replica: 2 steps x 2 replicas), not the warmup step and
    not the rest of the epoch, and its folder goes to the logger as the run's `profile/` artifacts."""
    profile = measured["profiles"][loop]
    [trace] = profile["files"]
    assert trace.startswith("plugins/profile/") and trace.endswith(".xplane.pb")
    assert profile["events"]["CollectiveOpV2Kernel::Run"] == 4
    assert [path for _, path in profile["artifacts"]] == ["profile"]


def test_each_rank_draws_its_own_dropout_masks(measured):
    """The same batch and initial weights, dropout 0.5: rank 1's masks are not rank 0's (the loss differs), and
    rank 0 rebuilt draws its masks again (the loss repeats exactly)."""
    rank0, rank1, rank0_again = measured["dropout"]
    assert rank0 == rank0_again and rank1 != rank0


def test_every_evaluation_reads_the_evaluation_set_once(measured):
    """Evaluations one after the other, from one iterator kept between them, each count the whole set exactly once:
    the right answers of the model on all of it."""
    evaluations = measured["evaluations"]
    assert evaluations["calls"] == [[evaluations["reference"], 300]] * 3


def test_chained_epochs_hold_one_copy_of_the_shard(measured):
    """An attempt's epochs chained into one dataset (trainers/tf/data.chained_epochs) gather their batches from one
    copy of the shard: 20 epochs add less than 4 shards' worth of memory (a copy per epoch added 43)."""
    memory = measured["chained_memory"]
    assert memory["added"] < 4 * memory["shard"], memory
