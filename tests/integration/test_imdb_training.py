"""A 2-worker DDP run of the tiny BERT on generated IMDb-format data, logged to a real MLflow server."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from contract.metrics import EPOCH_METRICS
from tests.conftest import pipeline_env, train_ok

pytestmark = pytest.mark.slow


def test_bert_tiny_ddp_learns_and_logs(tmp_path, tiny_imdb, mlflow_server, ray_head):
    args = [f"data.path={tiny_imdb}", "data=imdb", "model=bert_tiny", "model.hidden=32", "model.heads=2",
            "trainer.epochs=4", "trainer.batch_size=16", "trainer.lr=0.002", f"run.storage_path={tmp_path}/ray"]
    # data=imdb must come before data.path so the override lands on the imdb group
    args = [args[1], *args[:1], *args[2:]]
    _, run_id = train_ok(args, pipeline_env(mlflow_server, ray_head))
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.name"] == "bert" and run.data.params["data.eval_split"] == "validation"
    history = {name: sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)
               for name in (*EPOCH_METRICS, "tokens_per_s")}
    assert all([m.step for m in h] == [1, 2, 3, 4] for h in history.values())
    losses = [m.value for m in history["train_loss"]]
    assert losses[-1] < 0.75 * losses[0]  # sentiment words make the generated reviews learnable
    assert history["test_accuracy"][-1].value >= 0.75  # chance is 0.5
    assert {"tokenizer.json", "data_manifest.json"} <= {a.path for a in client.list_artifacts(run_id)}
