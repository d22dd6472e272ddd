"""trainer=deepspeed end to end through the driver: a real Ray head and MLflow server, DeepSpeed's engine (ZeRO-3) in 2
Ray Train workers over gloo, a DeepSpeed JSON of the user's under the recipe's keys; the run contract every backend
keeps, each rank holding half of the parameters, and the logged model (the dense fp32 model DeepSpeed consolidates
from the partitions) predicting what the run measured. Stop/resume and loss parity per ZeRO stage:
tests/unit/test_loop_backends.py; the dense reference at 2 ranks and loading at another world size:
tests/parallel/test_deepspeed_loop.py."""
from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import check_finished_run, check_step_losses_are_global, pipeline_env, read_split, train_ok

pytestmark = pytest.mark.slow


def test_zero3_run_keeps_the_contract_and_logs_the_dense_model(tmp_path, tiny_mnist, mlflow_server, ray_head):
    env = pipeline_env(mlflow_server, ray_head)
    user_json = tmp_path / "ds.json"
    user_json.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                     "wall_clock_breakdown": False}))
    _, run_id = train_ok(["trainer=deepspeed", "trainer.zero_stage=3", f"trainer.deepspeed_config={user_json}",
                          f"data.path={tiny_mnist}", "trainer.epochs=2", "trainer.batch_size=16",
                          "trainer.optimizer=adamw", "trainer.weight_decay=0.01", "trainer.lr=0.005",
                          "trainer.grad_clip=1.0", "trainer.log_every_n_steps=1", "model.hidden=[32]",
                          "model.dropout=0", f"run.storage_path={tmp_path / 'ray'}"], env)
    client = MlflowClient(mlflow_server)
    model_uri = check_finished_run(client, run_id, "deepspeed", epochs=2)
    check_step_losses_are_global(client, run_id, epochs=2)
    metrics = client.get_run(run_id).data.metrics
    dense_bytes = 4 * (784 * 32 + 32 + 32 * 10 + 10)  # the MLP's float32 parameters
    for rank in (0, 1):  # ZeRO-3 with no parameter kept whole (persistence threshold 0): half each
        assert abs(metrics[f"rank{rank}.param_bytes"] / dense_bytes - 0.5) < 0.01

    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pytorch.load_model(model_uri)  # an exported program, in eval mode
    features, labels = read_split(tiny_mnist, "test")
    with torch.no_grad():
        predicted = model(torch.from_numpy(features)).argmax(dim=1).numpy()
    epoch = int(client.get_run(run_id).data.tags["final_model_epoch"])
    at_epoch = {m.step: m.value for m in client.get_metric_history(run_id, "test_accuracy")}[epoch]
    assert float(np.mean(predicted == labels)) == pytest.approx(at_epoch, abs=1e-9) and at_epoch > 0.5
