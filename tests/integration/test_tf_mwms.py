"""TensorFlow MultiWorkerMirroredStrategy backend end to end: a real Ray head, a real MLflow server, 2 CPU
workers over RING collectives, with Keras `fit` (the custom `strategy.run` loop crosses two Slurm nodes in
tests/slurm). Stop/resume parity, several devices per worker, the text metric set and the checkpoint's
optimizer state are checked in-process (tests/unit/test_loop_backends.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, check_finished_run, pipeline_env, train_ok

pytestmark = pytest.mark.slow
TINY = ["trainer=tf_mwms", "trainer.tf_communication=ring", "trainer.batch_size=32", "model.hidden=[32]",
        "trainer.threads_per_worker=1", "trainer.epochs=2"]


def train(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, str]:
    return train_ok([*TINY, *args], env)


def check_run(client: MlflowClient, run_id: str, epochs: int = 2) -> str:
    """The shared run contract (a Keras model logged), plus data_load_s."""
    model_uri = check_finished_run(client, run_id, "tf_mwms", epochs)
    assert len(client.get_metric_history(run_id, "data_load_s")) >= 1
    return model_uri


def check_replicas_identical(params_dir) -> list[np.ndarray]:
    """The all-reduce keeps replicas in step. Exact equality: both workers apply the same summed gradient
    to the same weights with the same ops, so their float32 results are bitwise identical."""
    rank0, rank1 = (np.load(params_dir / f"rank{r}.npz") for r in (0, 1))
    assert rank0.files == rank1.files and rank0.files
    for key in rank0.files:
        np.testing.assert_array_equal(rank0[key], rank1[key])
    return [rank0[key] for key in rank0.files]


def test_fit_loop_syncs_trains_logs_and_resumes_after_a_failure(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """Keras `fit` on 2 workers, one failing at epoch 2: the run resumes from epoch 1's checkpoint (weights,
    optimizer state, epoch), the MLflow run holds each epoch once, the replicas stay identical and the logged
    model holds the trained weights."""
    marker = tmp_path / "failed-once"
    proc, run_id = train([f"data.path={tiny_mnist}", "trainer.tf_loop=fit", f"run.storage_path={tmp_path / 'ray'}",
                          f"run.dump_params_dir={tmp_path / 'params'}", "fault.max_failures=1",
                          "fault.inject_at_epoch=2", f"fault.inject_marker={marker}"],
                         pipeline_env(mlflow_server, ray_head))
    assert marker.read_text().startswith("failed at epoch 2 in rank 1")
    client = MlflowClient(mlflow_server)
    model_uri = check_run(client, run_id)
    assert client.get_run(run_id).data.tags["resumed_from_epoch"] == "1"
    weights = check_replicas_identical(tmp_path / "params")
    # The logged model loads (tf-keras: with TF_USE_LEGACY_KERAS=1) and holds the trained weights.
    np.savez(tmp_path / "expected.npz", *weights)
    code = ("import sys, numpy as np, mlflow; mlflow.set_tracking_uri(sys.argv[1]);"
            "import mlflow.tensorflow as mt;"
            "m = mt.load_model(sys.argv[2]); e = np.load(sys.argv[3]);"
            "w = m.get_weights(); assert len(w) == len(e.files);"
            "assert all(np.array_equal(a, e[k]) for a, k in zip(w, e.files));"
            "assert m.predict(np.zeros((4, 784), np.float32), verbose=0).shape == (4, 10); print('ok')")
    env = {**pipeline_env(mlflow_server), "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    load = subprocess.run([sys.executable, "-c", code, mlflow_server, model_uri, str(tmp_path / "expected.npz")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert load.returncode == 0 and load.stdout.strip().endswith("ok"), load.stderr[-3000:]
