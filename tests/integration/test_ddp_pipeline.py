"""End to end on real components: a `ray start` head, a real `mlflow server`, Parquet shards via Ray Data,
2 DDP workers over gloo."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from mlflow.tracking import MlflowClient

from contract.metrics import EPOCH_METRICS
from tests.conftest import ROOT, metric_steps, pipeline_env, run_id_from, run_pipeline

pytestmark = pytest.mark.slow
TINY = ["trainer.batch_size=32", "model.hidden=[64]", "trainer.threads_per_worker=1"]


def test_job_submit_trains_logs_syncs_and_resumes_after_a_failure(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """`ray job submit --working-dir .` of the real pipeline against the test's own Ray head; rank 1 fails at
    epoch 2 and Ray Train restarts the workers from epoch 1's checkpoint (not from scratch)."""
    marker = tmp_path / "failed-once"
    env = pipeline_env(mlflow_server, ray_head)
    runtime_env = {"excludes": ["/.venv", "/.git", "/data", "/outputs", "/mlflow.db", "/mlartifacts"],
                   "env_vars": {k: env[k] for k in ("MLFLOW_TRACKING_URI", "OMP_NUM_THREADS",
                                                    "RAY_TRAIN_ENABLE_PROGRESS_BAR")}}
    cmd = ["ray", "job", "submit", "--address", ray_head["RAY_DASHBOARD_ADDRESS"], "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "-m", "pipelines.train", f"data.path={tiny_mnist}", "trainer.epochs=3",
           f"run.storage_path={tmp_path / 'ray'}", f"run.dump_params_dir={tmp_path / 'params'}", *TINY,
           "fault.max_failures=1", "fault.inject_at_epoch=2", f"fault.inject_marker={marker}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run_id = run_id_from(proc.stdout)

    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer.num_workers"] == "2" and params["world_size"] == "2" and params["backend"] == "ddp"
    assert params["version.ray"] == "2.60.0" and params["version.torch"].startswith("2.13.0")
    assert "mlflow.source.git.commit" in run.data.tags
    assert marker.read_text().startswith("failed at epoch 2 in rank 1")
    assert run.data.tags["resumed_from_epoch"] == "1"  # restarted from epoch 1's checkpoint, not from scratch
    for name in EPOCH_METRICS:
        assert metric_steps(client, run_id, name) == [1, 2, 3], name  # every epoch exactly once
    losses = [m.value for m in sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)]
    assert losses[-1] < losses[0]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert "config.yaml" in artifacts

    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run_id}'", output_format="list")
    assert len(models) == 1
    model = mlflow.pytorch.load_model(models[0].model_uri)
    assert model(torch.zeros(4, 784)).shape == (4, 10)

    rank0, rank1 = (torch.load(tmp_path / "params" / f"rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        torch.testing.assert_close(rank0[key], rank1[key], rtol=0, atol=0)  # DDP keeps replicas identical
    # The logged model is the trained one, not a fresh initialisation.
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, rank0[key], rtol=0, atol=0)


def test_failed_run_is_marked_failed_with_the_error(tmp_path, tiny_mnist, mlflow_server, ray_head):
    marker = tmp_path / "failed-once"
    proc = run_pipeline([f"data.path={tiny_mnist}", "trainer.epochs=2", f"run.storage_path={tmp_path / 'ray'}",
                         "fault.max_failures=0", "fault.inject_at_epoch=1", f"fault.inject_marker={marker}",
                         *TINY], pipeline_env(mlflow_server, ray_head))
    assert proc.returncode == 1
    run = MlflowClient(mlflow_server).get_run(run_id_from(proc.stdout))
    assert run.info.status == "FAILED"
    assert "injected failure at epoch 1" in run.data.tags["error"]
