"""TensorFlow MultiWorkerMirroredStrategy backend end to end: a real Ray head, a real MLflow server, 2 CPU
workers over RING collectives, with Keras `fit` (the custom `strategy.run` loop crosses two Slurm nodes in
tests/slurm). Stop/resume parity, several devices per worker, the text metric set and the checkpoint's
optimizer state are checked in-process (tests/unit/test_loop_backends.py)."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from contract.console import ABSL_PRE_INIT_BANNER, CUINIT_FAILED, NO_CUDA_DRIVER
from tests.conftest import check_finished_run, evaluate_ok, pipeline_env, read_split, train_ok

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


def check_quiet(proc: subprocess.CompletedProcess) -> None:
    """No TensorFlow chatter in a command's output: its pre-initialisation lines filtered by
    TF_CPP_MIN_LOG_LEVEL=2 (contract/console.py), no Python INFO lines of the strategy, no Keras progress line, no
    warning from the logged model's weights loading."""
    output = proc.stdout + proc.stderr
    for chatter in (ABSL_PRE_INIT_BANNER, "oneDNN custom operations", NO_CUDA_DRIVER, CUINIT_FAILED,
                    "MultiWorkerMirroredStrategy with cluster_spec", "Collective all_reduce tensors",
                    "Skipping variable loading for optimizer"):
        assert chatter not in output, chatter
    assert not re.search(r"\d+/\d+ \[=+", output), output[-3000:]


def test_fit_loop_syncs_trains_logs_and_resumes_after_a_failure(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """Keras `fit` on 2 workers, one failing at epoch 2: the run resumes from epoch 1's checkpoint (weights,
    optimizer state, epoch), the MLflow run holds each epoch once, the replicas stay identical and the logged
    model holds the trained weights."""
    marker = tmp_path / "failed-once"
    proc, run_id = train([f"data.path={tiny_mnist}", "trainer.tf_loop=fit", f"run.storage_path={tmp_path / 'ray'}",
                          f"run.dump_params_dir={tmp_path / 'params'}", "fault.max_failures=1",
                          "fault.inject_at_epoch=2", f"fault.inject_marker={marker}", "run.system_metrics=false",
                          "run.system_metrics_interval_s=1", "run.progress=on"],
                         pipeline_env(mlflow_server, ray_head))
    assert marker.read_text().startswith("failed at epoch 2 in rank 1")
    for epoch in (1, 2):  # rank 0's bar of each epoch's 16 fit steps, rendered by the driver (run.progress=on)
        assert re.search(rf"train epoch {epoch}/2: +\d+%\|.*\| [\d.]+/16", proc.stderr), proc.stderr[-3000:]
    # Every TensorFlow process of the run (the driver imports none; 2 workers, each twice, and the model's logging
    # task, where MLflow predicts on the input example) started and ran quietly.
    check_quiet(proc)
    client = MlflowClient(mlflow_server)
    check_run(client, run_id)
    assert not [name for name in client.get_run(run_id).data.metrics if name.startswith("system/")]  # turned off
    assert client.get_run(run_id).data.tags["resumed_from_epoch"] == "1"
    weights = check_replicas_identical(tmp_path / "params")
    check_evaluation(client, run_id, weights, tiny_mnist, pipeline_env(mlflow_server, ray_head))


def check_evaluation(client: MlflowClient, run_id: str, weights: list[np.ndarray], data, env) -> None:
    """`pipelines.evaluate` loads the logged tf-keras model in Ray Data actors (TF_USE_LEGACY_KERAS=1 there) and
    scores the training run's test split: the loss is that of the trained weights (the replicas' dump, the MLP's
    forward in float64 numpy) and the accuracy the training run's last one."""
    proc, evaluation_id = evaluate_ok(run_id, env)
    check_quiet(proc)  # the scoring actors: no Keras progress line per batch
    evaluation = client.get_run(evaluation_id)
    assert evaluation.info.status == "FINISHED" and evaluation.data.tags["training_run_id"] == run_id
    features, labels = read_split(data, "test")
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)  # Dense(32, relu) -> Dense(10); dropout off
    logits = np.maximum(features @ w1 + b1, 0.0) @ w2 + b2
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(len(labels)), labels].mean()
    metrics = evaluation.data.metrics
    np.testing.assert_allclose(metrics["test_loss"], loss, rtol=1e-4, atol=1e-6)  # TF computes in float32
    last = max(client.get_metric_history(run_id, "test_accuracy"), key=lambda m: m.step).value
    assert abs(metrics["test_accuracy"] - last) <= 1 / len(labels) and metrics["test_rows"] == len(labels)
