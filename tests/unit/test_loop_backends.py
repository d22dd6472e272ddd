"""Stop/resume parity and the metric set for the Horovod (torch, tf) and tf_mwms adapters on the shared loop,
each attempt in a fresh process (tests/loop_backends.py), no Ray cluster. DDP and TP: tests/unit/test_loop.py and
tests/parallel/test_tp_loop.py. Horovod runs as a lone process: the 2-rank paths are in tests/integration."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.loop_harness import attempt_from_json, check_metric_set, check_parity, last_checkpoint


def attempt(backend: str, folder, name: str, restore=None):
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.loop_backends", backend, str(folder / backend), name, *([str(restore)] if restore else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return attempt_from_json(json.loads(proc.stdout.strip().splitlines()[-1]))


# Horovod accumulates 2 batches per optimizer step: the stop at step 10 lands between optimizer steps.
@pytest.mark.parametrize("backend", ["horovod_torch", "horovod_tf", "tf_mwms_custom"])
def test_stop_resume_parity(tmp_path, backend):
    runs = {"straight": attempt(backend, tmp_path, "straight"), "stopped": attempt(backend, tmp_path, "stopped")}
    runs["resumed"] = attempt(backend, tmp_path, "resumed", last_checkpoint(tmp_path / backend / "stopped"))
    # The same ops in the same order after a restore: float32 results agree to rounding.
    check_parity(runs, epochs=2, text=False, rtol=1e-5, atol=1e-6)
    rows_per_step = 32 if backend == "tf_mwms_custom" else 16  # tf_devices=2: 2 replicas x 16 rows
    assert len(runs["straight"].recorder.step_losses) == 320 // rows_per_step * 2


def test_keras_fit_keeps_the_contract(tmp_path):
    """Keras `fit` hands its epochs to the same loop: the text metric set (tokens_per_s) and a checkpoint of
    the same schema, which the custom loop's resume reads."""
    fit = attempt("tf_mwms_fit", tmp_path, "straight")
    assert fit.finished
    check_metric_set(fit.recorder, 2, text=True)
    # log_every_n_steps=1, but fit hands the loss over every tf_steps_per_execution=4 steps: one mean per window
    assert sorted(fit.recorder.step_losses) == list(range(4, 41, 4))


def test_two_devices_take_the_steps_of_one_device_with_the_double_batch(tmp_path):
    """`trainer.tf_devices=2` (MirroredStrategy over two logical CPU devices) with 16 rows per replica takes the
    same steps as one device with 32 rows: same rows per step, gradients averaged over the global batch. Keras
    `fit` over the same two devices logs the mean loss of each 2-step window of that curve."""
    one = attempt("tf_one_device", tmp_path, "straight").recorder.curve()
    two = attempt("tf_mwms_custom", tmp_path, "straight").recorder.curve()
    fit = attempt("tf_two_devices_fit", tmp_path, "straight").recorder
    assert len(one) == len(two) == 20  # 320 rows / 32 per step x 2 epochs
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    assert sorted(fit.step_losses) == list(range(2, 21, 2))
    np.testing.assert_allclose([fit.step_losses[s] for s in range(2, 21, 2)], two.reshape(10, 2).mean(axis=1),
                               rtol=1e-3, atol=1e-4)
