"""Stop on request and resume (`run.resume_dir`, contract/resume.py) end to end through the driver: a real Ray
head, a real MLflow server, 2 DDP workers, exit code 3, the KILLED run continued into FINISHED. The resumed run
must be the uninterrupted run, step for step. Every other backend's loop is checked for the same parity
in-process (tests/unit/test_loop.py, test_loop_backends.py, tests/parallel/test_tp_loop.py): the loop and the
checkpoint schema are shared, so the Ray path is the same for all."""
from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import metric_steps, pipeline_env, run_id_from, run_pipeline

pytestmark = pytest.mark.slow


def step_loss_curve(client: MlflowClient, run_id: str) -> torch.Tensor:
    history = sorted(client.get_metric_history(run_id, "step_loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, len(history) + 1))  # every step once
    return torch.tensor([m.value for m in history], dtype=torch.float64)


def test_stop_request_checkpoints_mid_epoch_and_resumes_the_same_curve(tmp_path, tiny_mnist, mlflow_server,
                                                                        ray_head):
    """A STOP file makes the run checkpoint at step 10 of epoch 1 and exit 3; the continued run skips the
    batches already trained on, so its loss curve is the uninterrupted run's, step for step."""
    env = pipeline_env(mlflow_server, ray_head)
    # 1024 rows / 2 workers / 16 = 32 steps per epoch; SGD with momentum: its buffers are in the checkpoint.
    common = [f"data.path={tiny_mnist}", "trainer.epochs=2", "trainer.batch_size=16",
              "trainer.optimizer=sgd", "trainer.lr=0.01", "trainer.log_every_n_steps=1", "model.hidden=[64]", "model.dropout=0",
              f"run.storage_path={tmp_path / 'ray'}"]
    straight = run_pipeline(common, env)
    assert straight.returncode == 0, straight.stderr[-3000:]

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

    (resume_dir / "STOP").unlink()
    resumed = run_pipeline([*common, f"run.resume_dir={resume_dir}"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert run_id_from(resumed.stdout) == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["attempts"] == "2"
    assert metric_steps(client, run_id, "train_loss") == [1, 2]
    expected = step_loss_curve(client, run_id_from(straight.stdout))
    assert len(expected) == 64
    torch.testing.assert_close(step_loss_curve(client, run_id), expected, rtol=1e-5, atol=1e-6)
