"""TensorFlow DTensor backend end to end: a real Ray head, a real MLflow server, 2 Ray workers as 2 DTensor clients
of 2 logical CPU devices each, on a 2x2 mesh (batch and model sharded). Sharded training
against plain TF, the DDP loss-parity gate and stop/resume are checked in-process (tests/unit/test_dtensor.py,
tests/unit/test_loop_backends.py)."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import check_finished_run, check_step_losses_are_global, pipeline_env, train_ok
from tests.integration.test_tf_mwms import check_evaluation, check_quiet

pytestmark = pytest.mark.slow


def test_two_clients_train_a_2x2_mesh_and_log_a_model_that_loads_without_it(tmp_path, tiny_mnist, mlflow_server,
                                                                            ray_head):
    """The run contract, both clients' gathered weights identical, one device holding half of the sharded weights,
    the logged Keras twin scoring as the trained weights do, and each step's loss the global batch's (the loop
    logs the step's own loss, a mean over the batch sharded across both clients): their mean over an epoch is
    the epoch's train_loss, which sums every client's losses."""
    env = pipeline_env(mlflow_server, ray_head)
    proc, run_id = train_ok(["trainer=tf_dtensor", "trainer.devices_per_worker=2", "trainer.mesh.batch=2",
                             "trainer.mesh.model=2", "trainer.batch_size=16", "model.hidden=[32]", "model.dropout=0",
                             "trainer.epochs=2", f"data.path={tiny_mnist}", f"run.storage_path={tmp_path / 'ray'}",
                             f"run.dump_params_dir={tmp_path / 'params'}", "run.system_metrics=false",
                             "trainer.log_every_n_steps=1"], env)
    client = MlflowClient(mlflow_server)
    check_finished_run(client, run_id, "tf_dtensor", epochs=2)
    run = client.get_run(run_id)
    assert (run.data.params["dp"], run.data.params["tp"]) == ("2", "2")
    rank0, rank1 = (np.load(tmp_path / "params" / f"rank{r}.npz") for r in (0, 1))
    weights = [rank0[f"arr_{i}"] for i in range(4)]  # Dense(784 -> 32) column-parallel, Dense(32 -> 10) row-parallel
    for i, weight in enumerate(weights):
        np.testing.assert_array_equal(rank1[f"arr_{i}"], weight)
    sharded, replicated = (784 * 32 + 32 + 32 * 10) * 4, 10 * 4
    assert run.data.metrics["device_weight_bytes"] == sharded / 2 + replicated
    check_evaluation(client, run_id, weights, tiny_mnist, env)
    check_step_losses_are_global(client, run_id, epochs=2)
    check_quiet(proc)
    for chatter in ("Enabling collectives with server_def", "This is client 0 of 2", "Local devices"):  # DTensor's
        assert chatter not in proc.stdout + proc.stderr, chatter
