"""Tensor parallelism on Ray Train, end to end: the 2D (dp=2 x tp=2) data layout and sync over 4 workers. The
loss curve against tp=1 and stop/resume parity are checked in-process (tests/parallel/test_tp_loop.py)."""
from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import pipeline_env, train_ok

pytestmark = pytest.mark.slow
TINY_BERT = ["trainer=tp", "data=imdb", "model=bert_tiny", "model.hidden=32", "model.heads=2", "model.dropout=0",
             "trainer.batch_size=16", "trainer.lr=0.001"]


def train(args: list[str], mlflow_server: str, ray_head: dict) -> str:
    _, run_id = train_ok([*TINY_BERT, *args], pipeline_env(mlflow_server, ray_head))
    assert MlflowClient(mlflow_server).get_run(run_id).info.status == "FINISHED"
    return run_id


def test_2d_dp2_tp2_data_layout_and_sync(tmp_path, tiny_imdb, mlflow_server, ray_head):
    dump = tmp_path / "dump"
    run_id = train([f"data.path={tiny_imdb}", "trainer.epochs=1", "trainer.num_workers=4", "trainer.tp=2",
                    f"run.storage_path={tmp_path}/ray", f"run.dump_params_dir={dump}"], mlflow_server, ray_head)
    rows = [torch.load(dump / f"rank{r}_rows.pt") for r in range(4)]
    torch.testing.assert_close(rows[0], rows[1], rtol=0, atol=0)  # TP group {0, 1}: same shard
    torch.testing.assert_close(rows[2], rows[3], rtol=0, atol=0)  # TP group {2, 3}: same shard
    assert not set(rows[0].tolist()) & set(rows[2].tolist())       # DP shards disjoint...
    assert len(rows[0]) + len(rows[2]) == 256                      # ...and covering the 256 train rows
    states = [torch.load(dump / f"rank{r}.pt") for r in range(4)]
    for other in states[1:]:  # after DP gradient averaging every replica holds the same (unsharded) model
        for key, value in states[0].items():
            torch.testing.assert_close(other[key], value, rtol=0, atol=0)
    metrics = MlflowClient(mlflow_server).get_run(run_id).data.metrics
    for r in range(4):
        assert metrics[f"rank{r}.param_count"] > 0 and metrics[f"rank{r}.peak_memory_bytes"] > 0
    assert metrics["rank0.collective_time_s"] > 0
    # TP halves the sharded matrices, so a rank holds fewer parameters than the dense model.
    dense_count = sum(v.numel() for v in states[0].values())
    assert metrics["rank0.param_count"] < dense_count
