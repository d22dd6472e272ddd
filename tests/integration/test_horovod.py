"""Horovod on Ray Train V2 end to end, for PyTorch and TensorFlow: a real Ray head, a real MLflow server, 2 CPU
workers joined by Horovod's Gloo rendezvous (trainers/horovod/rendezvous.py). Needs horovod built into the venv
(tests/run.sh builds it); without it these fail at `import horovod`, they do not skip."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import (ROOT, check_finished_run, check_step_losses_are_global, pipeline_env, run_id_from,
                            run_pipeline, train_ok)
from tests.support.horovod_checks import BATCHES_PER_EPOCH, check_replicas_identical, init_log, optimizer_steps

pytestmark = pytest.mark.slow
FRAMEWORKS = ["torch", "tf"]
TINY = ["trainer=horovod", "trainer.batch_size=32", "model.hidden=[32]", "trainer.threads_per_worker=1",
        "trainer.epochs=2"]


def train(args: list[str], env: dict[str, str], base: list[str] = TINY) -> str:
    return train_ok([*base, *args], env)[1]


def check_run(client: MlflowClient, run_id: str) -> str:
    """The shared run contract on 2 workers; returns the logged model's URI."""
    assert client.get_run(run_id).data.params["world_size"] == "2"
    return check_finished_run(client, run_id, "horovod", epochs=2)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_allreduce_of_known_values(tmp_path, ray_head, framework):
    """The backend alone (no pipeline): Horovod sees 2 ranks in Ray's rank order, one node, and its collectives
    give the known answers."""
    env = pipeline_env("unused", ray_head)
    proc = subprocess.run([sys.executable, "-m", "tests.support.horovod_probe", framework,
                           str(tmp_path / "out"), str(tmp_path / "ray")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, got in enumerate(ranks):
        assert (got["rank"], got["ray_rank"], got["size"]) == (rank, rank, 2)
        assert (got["local_rank"], got["local_size"], got["cross_rank"], got["cross_size"]) == (rank, 2, 0, 1)
        assert got["sum"] == [3.0, 30.0]  # (1 + 2), (10 + 20)
        assert got["average"] == [1.5, 15.0]
        assert got["max"] == [2.0, 20.0]
        assert got["fp16_sum"] == [3.0, 30.0]  # exact in float16 too
        assert got["allgather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["broadcast"] == [8.0]  # rank 1's 1 + 7
        if framework == "torch":  # a channels-last model's tensors (trainers/horovod/torch.ContiguousCompression)
            assert got["channels_last"] == {"average": [1.5], "into_the_gradient": True, "broadcast": [5.0],
                                            "layouts_kept": True}
        env_vars = got["env"]
        assert env_vars["HOROVOD_CONTROLLER"] == "gloo" and env_vars["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env_vars["HOROVOD_GLOO_IFACE"] == "lo"  # one node: loopback, as horovodrun picks for local hosts
    assert ranks[0]["env"]["HOROVOD_HOSTNAME"] == ranks[1]["env"]["HOROVOD_HOSTNAME"]  # the Ray node id


def test_tf_trains_with_fp16_and_accumulation_and_resumes_after_failure(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """fp16 compression and 2 backward passes per step, and rank 1 failing at epoch 2: Ray Train restarts the
    worker group from epoch 1's checkpoint; the new workers (new processes) do a new rendezvous and train on.
    Still identical replicas, a falling loss, each epoch once in MLflow, the optimizer stepped once per 2 batches
    (its step counter in the final checkpoint, restored across the restart). The same for torch runs across the two
    Slurm nodes (tests/slurm/test_ray_cluster.py), where a real network separates the ranks."""
    framework = "tf"
    marker, params = tmp_path / "failed-once", tmp_path / "params"
    run_id = train([f"trainer.framework={framework}", f"data.path={tiny_mnist}", "trainer.compression=fp16",
                    "trainer.grad_accum=2", "trainer.log_every_n_steps=1", "fault.max_failures=1",
                    "fault.inject_at_epoch=2", f"fault.inject_marker={marker}", f"run.storage_path={tmp_path / 'ray'}",
                    f"run.dump_params_dir={params}"], pipeline_env(mlflow_server, ray_head))
    assert marker.read_text().startswith("failed at epoch 2 in rank 1")
    client = MlflowClient(mlflow_server)
    check_run(client, run_id)
    assert client.get_run(run_id).data.tags["resumed_from_epoch"] == "1"
    check_step_losses_are_global(client, run_id, epochs=2)  # each all-reduced on a thread of its own
    check_replicas_identical(params, framework)
    assert optimizer_steps(tmp_path / "ray", framework) == 2 * BATCHES_PER_EPOCH // 2  # 2 epochs, grad_accum=2
    first, second = init_log(params)[:2], init_log(params)[2:]
    assert len(second) == 2, init_log(params)
    for attempt in (first, second):
        assert sorted(line["rank"] for line in attempt) == ["0", "1"]
        assert len({line["rendezvous"] for line in attempt}) == 1  # both ranks met at the same server
    assert not {line["pid"] for line in first} & {line["pid"] for line in second}  # new processes


def test_tf_runs_several_steps_per_compiled_call_across_ranks(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """Without accumulation the TF step loop runs 4 steps per compiled call (`trainer.tf_steps_per_execution`), each
    step's allreduce inside the graph loop, on 2 ranks: identical replicas, each step's loss the global batch's mean,
    the optimizer stepped once per batch."""
    params = tmp_path / "params"
    run_id = train(["trainer.framework=tf", f"data.path={tiny_mnist}", "trainer.tf_steps_per_execution=4",
                    "trainer.log_every_n_steps=1", f"run.storage_path={tmp_path / 'ray'}",
                    f"run.dump_params_dir={params}"], pipeline_env(mlflow_server, ray_head))
    client = MlflowClient(mlflow_server)
    check_run(client, run_id)
    check_step_losses_are_global(client, run_id, epochs=2)
    check_replicas_identical(params, "tf")
    assert optimizer_steps(tmp_path / "ray", "tf") == 2 * BATCHES_PER_EPOCH


def test_torch_streamed_run_stopped_on_2_workers_continues_on_1_in_the_same_sequence(tmp_path, tiny_mnist,
                                                                                     mlflow_server, ray_head):
    """What an elastic horovod run (`trainer.min_workers`) does when it shrinks: a streamed torch run stopped at step
    10 of 32 on 2 workers, continued on 1 worker with the same global batch (a rendezvous of one), trains the steps
    of the uninterrupted 2-worker run to the same losses. Ray Train's resizing itself is tests/integration/
    test_elastic.py's (ddp); the other elastic backends' loops are tests/parallel/test_streamed_loop.py's."""
    env = pipeline_env(mlflow_server, ray_head)
    common = ["trainer=horovod", "trainer.framework=torch", f"data.path={tiny_mnist}", "trainer.epochs=1",
              "model.hidden=[32]", "model.dropout=0", "trainer.optimizer=sgd", "trainer.lr=0.05",
              "trainer.log_every_n_steps=1", "trainer.threads_per_worker=1", "data.cache_in_worker=false",
              "data.shuffle_buffer=256"]
    two = ["trainer.num_workers=2", "trainer.batch_size=16"]  # 1024 rows in global batches of 32: 32 steps
    straight = train([*two, f"run.storage_path={tmp_path / 'straight'}"], env, base=common)
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    (resume_dir / "STOP").touch()
    storage = f"run.storage_path={tmp_path / 'elastic'}"
    stopped = run_pipeline([*common, *two, storage, f"run.resume_dir={resume_dir}"], env)
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    (resume_dir / "STOP").unlink()
    resumed = train(["trainer.num_workers=1", "trainer.batch_size=32", storage, f"run.resume_dir={resume_dir}"], env,
                    base=common)
    client = MlflowClient(mlflow_server)
    assert resumed == run_id_from(stopped.stdout)
    assert client.get_run(resumed).data.tags["resumed_from_step"] == "epoch 1 step 10"
    losses = {name: {m.step: m.value for m in client.get_metric_history(run, "step_loss")}
              for name, run in (("straight", straight), ("resumed", resumed))}
    assert sorted(losses["resumed"]) == sorted(losses["straight"]) == list(range(1, 33))
    for step in range(1, 33):  # one rank's mean over 32 rows against two ranks' over 16 each, averaged
        torch.testing.assert_close(losses["resumed"][step], losses["straight"][step], rtol=1e-5, atol=1e-7,
                                   msg=f"step {step}")
