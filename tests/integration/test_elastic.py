"""An elastic run (`trainer.min_workers`) on a local Ray of several nodes (loopback addresses, one CPU each, as
cluster/local/ray-local.sh joins them): a node lost mid-epoch, the run goes on with the workers left from its last
checkpoint without waiting for the node; a node joins and the run grows back. The same global batch throughout, so
it trains what a run that never resized trains."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from pipelines.prepare import main as prepare_main
from tests.conftest import ROOT, check_finished_run, pipeline_env, run_id_from, run_pipeline, wait_until
from tests.support.local_ray import LOOPBACK_NODES, join_node, lose_node, started_ray_head

pytestmark = pytest.mark.slow  # a Ray of four nodes

@pytest.fixture
def three_nodes(tmp_path):
    """A head with no CPUs for workers (the driver's and Ray Train's controller run there) and three nodes of one
    CPU each: one worker per node."""
    state = tmp_path / "ray_state"
    with started_ray_head(state, 0, RAY_LOCAL_NODES="1") as values:
        for slot in LOOPBACK_NODES:
            join_node(state, values, slot)
        yield state, values


def step_losses(client: MlflowClient, run_id: str) -> dict[int, list[float]]:
    losses: dict[int, list[float]] = defaultdict(list)
    for m in client.get_metric_history(run_id, "step_loss"):
        losses[m.step].append(m.value)
    return losses


def committed_checkpoint(storage: Path, run_id: str) -> str | None:
    """The run's latest checkpoint Ray Train has committed (its folder's name), as its checkpoint manager's snapshot
    names it; None: none yet. A rank's report is committed once every rank's report of that step has reached the
    controller, some steps after the rank trained it; a node lost before that takes the run back to its start."""
    snapshot = storage / f"run-{run_id}" / "checkpoint_manager_snapshot.json"
    try:
        latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]
    except (OSError, ValueError):  # not written yet, or being written
        return None
    return latest["checkpoint_dir_name"] if latest else None


def test_a_run_that_loses_a_node_goes_on_smaller_and_grows_back(tmp_path, three_nodes, mlflow_server):
    state, ray_env = three_nodes
    data = tmp_path / "data"
    assert prepare_main(["synthetic", "--rows", "6000", "--features", "16", "--rows-per-shard", "600",
                         "--out", str(data)]) == 0
    # 4800 training rows in global batches of 48 (16 a rank at 3 workers, 24 at 2): 100 steps an epoch.
    common = ["trainer=ddp", "model=mlp", "model.hidden=[32]", "model.dropout=0", f"data.path={data}",
              "trainer.num_workers=3", "trainer.batch_size=16", "trainer.epochs=3", "trainer.optimizer=sgd",
              "trainer.lr=0.05", "trainer.lr_schedule=cosine", "trainer.log_every_n_steps=1",
              "data.cache_in_worker=false", "data.shuffle_buffer=600", "run.checkpoint_every_n_steps=5",
              "fault.max_failures=3",
              "run.final_model=last"]
    pipeline = pipeline_env(mlflow_server, ray_env)
    cmd = [sys.executable, "-m", "pipelines.train", *common, "trainer.min_workers=2", "trainer.resize_check_s=5",
           f"run.storage_path={tmp_path / 'elastic'}"]
    errors = tmp_path / "stderr.log"  # Ray's lines about the lost node: more than a pipe holds unread
    proc = subprocess.Popen(cmd, cwd=ROOT, env=pipeline, stdout=subprocess.PIPE, stderr=errors.open("w"), text=True)
    client = MlflowClient(mlflow_server)
    try:
        run_id = next(line.split()[2] for line in proc.stdout if line.startswith("MLflow run "))
        wait_until(lambda: max(step_losses(client, run_id), default=0) >= 17, 300, "step 17")
        committed = lambda: committed_checkpoint(tmp_path / "elastic", run_id)  # noqa: E731
        wait_until(committed, 300, "a committed checkpoint")
        lose_node(state, ray_env, 3)
        tags = lambda: client.get_run(run_id).data.tags.get("workers", "")  # noqa: E731
        wait_until(lambda: "2 from" in tags(), 300, "the run going on with 2 workers")
        by_three = committed()
        wait_until(lambda: committed() != by_three, 300, "a checkpoint of the 2 workers")
        join_node(state, ray_env, 3)
        proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, errors.read_text()[-3000:]
    elastic_model = check_finished_run(client, run_id, "ddp", 3)
    run = client.get_run(run_id)
    sizes = run.data.tags["workers"].split(",")
    assert len(sizes) == 3 and sizes[0] == "3 from the start", sizes
    took_over = r"(\d) from epoch (\d) step (\d+) \((\w+) from (\d): [^)]*\)"  # and from the size that wrote it
    lost, grown = (re.fullmatch(took_over, size) for size in sizes[1:])
    assert lost and lost[1] == "2" and lost.group(4, 5) == ("shrunk", "3"), sizes
    assert grown and grown[1] == "3" and grown.group(4, 5) == ("grown", "2"), sizes
    for where in (lost, grown):  # each took over at a checkpoint: inside an epoch (every 5 steps), or its start
        assert int(where[3]) % 5 == 0, sizes
    losses = step_losses(client, run_id)
    assert sorted(losses) == list(range(1, 301))  # every step of the 3 epochs, each at least once
    for step, values in losses.items():  # a step trained again (after a restart) on the same rows, to the same loss
        torch.testing.assert_close(min(values), max(values), rtol=1e-5, atol=0, msg=f"step {step}")
    sized = {m.step: m.value for m in client.get_metric_history(run_id, "world_size")}  # each epoch's last size
    assert sorted(sized) == [1, 2, 3] and set(sized.values()) <= {2.0, 3.0} and sized[3] == 3.0

    fixed = run_pipeline([*common, f"run.storage_path={tmp_path / 'fixed'}"], pipeline)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    fixed_id = run_id_from(fixed.stdout)
    fixed_losses = step_losses(client, fixed_id)
    for step in range(1, 301):  # 16 rows a rank or 24: the same global mean, summed in another order
        torch.testing.assert_close(losses[step][-1], fixed_losses[step][0], rtol=1e-4, atol=1e-6, msg=f"step {step}")
    elastic = mlflow.pytorch.load_model(elastic_model).state_dict()
    for name, value in mlflow.pytorch.load_model(check_finished_run(client, fixed_id, "ddp", 3)).state_dict().items():
        torch.testing.assert_close(elastic[name], value, rtol=1e-4, atol=1e-6, msg=name)
