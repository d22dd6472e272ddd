"""trainer=lightning end to end through the driver: a real Ray head and MLflow server, Lightning's Trainer in 2 Ray
Train workers (Ray's RayDDPStrategy and RayLightningEnvironment over gloo), stopped by STOP mid-epoch and continued
into the same MLflow run, which ends FINISHED with the run contract every backend keeps; the logged model predicts
what the trained one does. Stop/resume parity step for step and loss parity with ddp: tests/unit/test_loop_backends.py
(in-process)."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import (check_finished_run, check_step_losses_are_global, metric_steps, pipeline_env, read_split,
                            run_id_from, run_pipeline, train_ok)

pytestmark = pytest.mark.slow


def test_lightning_run_stops_resumes_into_the_same_run_and_logs_its_model(tmp_path, tiny_mnist, mlflow_server,
                                                                          ray_head):
    env = pipeline_env(mlflow_server, ray_head)
    # 1024 rows / 2 workers / 16 = 32 steps per epoch, 2 batches per optimizer step: the stop at step 10 is on an
    # update boundary.
    common = ["trainer=lightning", f"data.path={tiny_mnist}", "trainer.epochs=2", "trainer.batch_size=16",
              "trainer.optimizer=sgd", "trainer.lr=0.05", "trainer.grad_accum=2", "trainer.log_every_n_steps=1",
              "model.hidden=[32]", "model.dropout=0", f"run.storage_path={tmp_path / 'ray'}",
              f"run.resume_dir={tmp_path / 'resume'}"]
    (tmp_path / "resume").mkdir()
    (tmp_path / "resume" / "STOP").touch()
    stopped = run_pipeline(common, env)
    assert stopped.returncode == 3, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    run_id = run_id_from(stopped.stdout)
    assert client.get_run(run_id).info.status == "KILLED"
    assert metric_steps(client, run_id, "step_loss") == list(range(1, 11))
    assert "GPU available" not in stopped.stdout + stopped.stderr  # Lightning's INFO lines: only with -v

    (tmp_path / "resume" / "STOP").unlink()
    resumed, resumed_id = train_ok(common, env)
    assert resumed_id == run_id
    model_uri = check_finished_run(client, run_id, "lightning", epochs=2)
    assert metric_steps(client, run_id, "step_loss") == list(range(1, 65))  # every step once
    check_step_losses_are_global(client, run_id, epochs=2)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["rank0.param_bytes"] == metrics["rank1.param_bytes"] > 0  # DDP: whole replicas

    # The logged model is the spec's plain MLP with the trained weights: it predicts as trained.
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pytorch.load_model(model_uri)  # an exported program, in eval mode
    features, labels = read_split(tiny_mnist, "test")
    with torch.no_grad():
        predicted = model(torch.from_numpy(features)).argmax(dim=1).numpy()
    accuracy = float(np.mean(predicted == labels))
    epoch = int(client.get_run(run_id).data.tags["final_model_epoch"])
    at_epoch = {m.step: m.value for m in client.get_metric_history(run_id, "test_accuracy")}[epoch]
    assert accuracy == pytest.approx(at_epoch, abs=1e-9) and accuracy > 0.5
