"""TensorFlow ParameterServerStrategy end to end: a real Ray head, a real MLflow server, 4 Ray workers (a chief, a
parameter server, 2 workers) whose TensorFlow servers are real processes, and two failures halfway through an
epoch: a worker's server dies (the coordinator gives its steps to the other worker, the run goes on), then the
parameter server's (Ray Train restarts the run from its checkpoint). A failing chief (`fault.kill_servers=
[chief:0@<epoch>]`, its hook tested in tests/unit/test_tf_config.py) raises in the training loop and takes the
same restart as any backend's failure (`fault.inject_at_epoch`, end to end for ddp, horovod and tf_mwms).
Stop/resume parity and the DDP loss-parity gate (one worker, weights split over 2 parameter servers) are checked
in-process (tests/unit/test_loop_backends.py)."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import check_finished_run, metric_steps, pipeline_env, train_ok
from tests.integration.test_tf_mwms import check_evaluation

pytestmark = pytest.mark.slow


def test_training_goes_on_through_a_killed_worker_and_restarts_after_a_killed_ps(tmp_path, tiny_mnist, mlflow_server,
                                                                                 ray_head):
    """Halfway through epoch 2 (steps in flight) worker 1's server is killed: worker 0 takes the steps, worker 1's
    server is started again, no restart of the run. Halfway through epoch 3 the parameter server is killed: Ray
    Train restarts the run from epoch 2's checkpoint. The run contract holds, every epoch logged once, and the
    logged model scores as the final weights do."""
    marker = tmp_path / "killed"
    proc, run_id = train_ok(["trainer=tf_ps", "trainer.num_ps=1", "trainer.num_workers=2", "trainer.batch_size=32",
                             "trainer.tf_steps_per_execution=1", "model.hidden=[32]", "model.dropout=0",
                             "trainer.epochs=3", f"data.path={tiny_mnist}", f"run.storage_path={tmp_path / 'ray'}",
                             f"run.dump_params_dir={tmp_path / 'params'}", "fault.max_failures=1",
                             "fault.kill_servers=[worker:1@2,ps:0@3]", f"fault.inject_marker={marker}",
                             "run.system_metrics=false"],
                            pipeline_env(mlflow_server, ray_head))
    assert marker.read_text().split() == ["worker:1@2", "ps:0@3"]
    logs = proc.stdout + proc.stderr  # the Ray workers' output, as the driver shows it
    said = "\n".join(line for line in logs.splitlines() if "tf_ps:" in line or "epoch " in line)
    assert "the worker:1 server exited with code -9; starting it again (restart 1)" in logs, said
    assert "the ps:0 server exited with code -9" in logs, said
    client = MlflowClient(mlflow_server)
    check_finished_run(client, run_id, "tf_ps", epochs=3)
    run = client.get_run(run_id)
    assert run.data.params["world_size"] == "2"
    # A restart from epoch 2's checkpoint (the parameter server); none for the worker
    assert run.data.tags["resumed_from_epoch"] == "2", said
    assert metric_steps(client, run_id, "test_accuracy") == [1, 2, 3]
    losses = [m.value for m in sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)]
    assert losses[2] < losses[1] < losses[0], (losses, said)  # the failures did not throw training off
    with np.load(tmp_path / "params" / "rank0.npz") as dump:
        weights = [dump[f"arr_{i}"] for i in range(4)]  # whole: Dense(784 -> 32) was split over no server (1 ps)
    check_evaluation(client, run_id, weights, tiny_mnist, pipeline_env(mlflow_server, ray_head))
