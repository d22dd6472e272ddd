"""Stop on request and resume (`run.resume_dir`, contract/resume.py) end to end through the driver: a real Ray
head, a real MLflow server, 2 DDP workers, exit code 3, the KILLED run continued into FINISHED from the mid-epoch
checkpoint, every step trained and logged once. That the resumed curve is the uninterrupted one, step for step, is
checked in-process for every backend's loop (tests/unit/test_loop.py, test_loop_backends.py,
tests/parallel/test_tp_loop.py), on the same shard class the workers use; that a worker's ordered shard is the
same rows in the same order on every attempt is tests/integration/test_shards.py. Also a failure inside an epoch:
Ray Train restarts the workers from the last checkpoint taken inside it (`run.checkpoint_every_n_steps`)."""
from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from mlflow.tracking import MlflowClient

from contract.checkpoint import BEST_CHECKPOINT, TrainState
from tests.conftest import metric_steps, pipeline_env, run_id_from, run_pipeline

pytestmark = pytest.mark.slow


def step_loss_curve(client: MlflowClient, run_id: str) -> torch.Tensor:
    history = sorted(client.get_metric_history(run_id, "step_loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, len(history) + 1))  # every step once
    return torch.tensor([m.value for m in history], dtype=torch.float64)


def test_stop_request_checkpoints_mid_epoch_and_resumes_every_step_once(tmp_path, tiny_mnist, mlflow_server,
                                                                        ray_head):
    """A STOP file makes the run checkpoint at step 10 of epoch 1 and exit 3; the continued run restores that
    checkpoint and trains the remaining 54 steps: 64 step losses, each step once, and each epoch once."""
    env = pipeline_env(mlflow_server, ray_head)
    # 1024 rows / 2 workers / 16 = 32 steps per epoch; SGD with momentum: its buffers are in the checkpoint.
    common = [f"data.path={tiny_mnist}", "trainer.epochs=2", "trainer.batch_size=16",
              "trainer.optimizer=sgd", "trainer.lr=0.01", "trainer.log_every_n_steps=1", "model.hidden=[64]",
              "model.dropout=0",
              f"run.storage_path={tmp_path / 'ray'}"]
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    (resume_dir / "STOP").touch()
    stopped = run_pipeline([*common, f"run.resume_dir={resume_dir}"], env)
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    run_id = run_id_from(stopped.stdout)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["preempted_at"] == "epoch 1 step 10"
    assert metric_steps(client, run_id, "train_loss") == []
    before = step_loss_curve(client, run_id)
    assert len(before) == 10

    assert "train epoch" not in stopped.stdout + stopped.stderr  # run.progress=auto, and no terminal: no bars

    (resume_dir / "STOP").unlink()
    resumed = run_pipeline([*common, f"run.resume_dir={resume_dir}", "run.progress=on"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # rank 0's bar of each epoch's steps, rendered by the driver (tqdm's "description: percent|bar| done/total")
    for epoch in (1, 2):
        assert re.search(rf"train epoch {epoch}/2: +\d+%\|.*\| [\d.]+/32", resumed.stderr), resumed.stderr[-3000:]
    assert run_id_from(resumed.stdout) == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["attempts"] == "2"
    assert metric_steps(client, run_id, "train_loss") == [1, 2]
    after = step_loss_curve(client, run_id)  # every step once: none retrained, none skipped
    assert len(after) == 64 and torch.equal(after[:10], before)
    assert client.get_run(run_id).data.tags["resumed_from_epoch"] == "0"


def test_a_failure_inside_an_epoch_restarts_from_its_last_step_checkpoint(tmp_path, tiny_mnist, mlflow_server,
                                                                           ray_head):
    """A checkpoint every 10 steps of a 32-step epoch, uploaded while training goes on; the last worker's process
    is killed (SIGKILL, as a lost node's) before step 15. Ray Train restarts both workers from the checkpoint of
    step 10, which train steps 11 to 32, and the run finishes with every step's loss logged: those up to the
    checkpoint once (sent with it), those of steps 11 to 14 twice at most (the second time alike) where the first
    attempt sent them before failing."""
    env = pipeline_env(mlflow_server, ray_head)
    marker = tmp_path / "failed-once"
    done = run_pipeline([f"data.path={tiny_mnist}", "trainer.epochs=1", "trainer.batch_size=16",
                         "trainer.optimizer=sgd", "trainer.lr=0.01", "trainer.log_every_n_steps=1",
                         "model.hidden=[64]", "model.dropout=0", "run.checkpoint_every_n_steps=10",
                         "run.keep_checkpoints=2", "fault.max_failures=1", "fault.inject_at_step=15",
                         "fault.inject_kill=true", f"fault.inject_marker={marker}",
                         f"run.storage_path={tmp_path / 'ray'}"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.read_text() == "failed at step 15 in rank 1\n"
    client = MlflowClient(mlflow_server)
    run_id = run_id_from(done.stdout)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "epoch 1 step 10"
    assert run.data.metrics["goodput.checkpoint_s"] > 0  # the restarted attempt's checkpoints at steps 20 and 30
    assert metric_steps(client, run_id, "train_loss") == [1]
    losses: dict[int, list[float]] = defaultdict(list)
    for m in client.get_metric_history(run_id, "step_loss"):
        losses[m.step].append(m.value)
    assert sorted(losses) == list(range(1, 33))
    again = {step: values for step, values in losses.items() if len(values) > 1}
    assert set(again) <= set(range(11, 15)), sorted(again)  # only the steps trained after the checkpoint, once more
    for step, values in again.items():  # the same model, batches and order: the same losses
        torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=0, msg=f"step {step}")
    # run.keep_checkpoints=2: the last two (step 30's and the epoch's end), and the best epoch's linked beside them
    folders = sorted(p for p in (tmp_path / "ray" / f"run-{run_id}").glob("checkpoint_*") if p.is_dir())
    states = [TrainState.read(folder) for folder in folders]
    assert [(s.epoch, s.partial and s.partial.steps) for s in states] == [(0, 30), (1, None)], folders
    best = TrainState.read(tmp_path / "ray" / f"run-{run_id}" / BEST_CHECKPOINT)
    assert (best.epoch, best.partial) == (1, None)
