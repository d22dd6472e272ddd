"""End to end on real components: a `ray start` head, a real `mlflow server`, Parquet shards via Ray Data,
2 DDP workers over gloo."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import mlflow.pytorch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from contract.checkpoint import BEST_CHECKPOINT
from contract.metrics import EPOCH_METRICS
from contract.tracking import FINAL_FILE, spooled
from pipelines.data.readers import Materializing, ResourceWait, parquet_datasets, within
from tests.conftest import (ROOT, check_finished_run, ctrl_c, evaluate_ok, free_port, interruptible, metric_steps,
                            pipeline_env, ray_init_on, read_split, run_id_from, run_pipeline, start_mlflow_server,
                            stop_mlflow_server, wait_until)

pytestmark = pytest.mark.slow
TINY = ["trainer.batch_size=32", "model.hidden=[64]", "trainer.threads_per_worker=1"]


def test_job_submit_trains_logs_syncs_and_resumes_after_a_failure(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """`ray job submit --working-dir . -- rtp train ...` against the test's own Ray head; rank 1 hangs in a
    collective at epoch 2's 4th step (global step 20) while rank 0 waits in that step's gradient all-reduce: the
    hang watchdog ends both after `fault.hang_timeout_s`, naming rank 1 and keeping every rank's stacks, and Ray
    Train restarts the workers from epoch 1's checkpoint (not from scratch). Rank 0 profiles 2 steps into the
    run's artifacts; the driver and rank 0 log system metrics; TensorBoard event files too. The final model is
    registered, and evaluated through the registry. Its preflight measures the process group's links. Its goodput
    puts the hang and the restart in the rest."""
    marker, registered = tmp_path / "hung-once", f"mnist-ddp-{tmp_path.name}"
    env = pipeline_env(mlflow_server, ray_head)
    runtime_env = {"excludes": ["/.venv", "/.git", "/data", "/outputs", "/mlflow.db", "/mlartifacts"],
                   "env_vars": {k: env[k] for k in ("MLFLOW_TRACKING_URI", "OMP_NUM_THREADS",
                                                    "RAY_DATA_DISABLE_PROGRESS_BARS")}}
    cmd = ["ray", "job", "submit", "--address", ray_head["RAY_DASHBOARD_ADDRESS"], "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--",
           "rtp", "train", f"data.path={tiny_mnist}", "trainer.epochs=3",
           f"run.storage_path={tmp_path / 'ray'}", f"run.dump_params_dir={tmp_path / 'params'}", *TINY,
           "fault.max_failures=1", "fault.hang_timeout_s=10", "fault.inject_hang_at_step=20",
           f"fault.inject_marker={marker}",
           f"run.register_model={registered}", "trainer.profile_steps=2", "run.system_metrics_interval_s=1",
           "run.tensorboard=true", "run.preflight=true"]
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
    # MLflow's own conventions, for its UI: the source, the command as the description, the data as inputs
    tags = run.data.tags
    assert tags["mlflow.source.name"] == "rtp train" and tags["mlflow.source.type"] == "JOB"
    assert "rtp train data.path=" in tags["mlflow.note.content"]
    assert "trainer.profile_steps=2" in tags["mlflow.note.content"]
    datasets = inputs_by_context(run)
    assert {context: d.name for context, d in datasets.items()} == {"training": "mnist-train", "eval": "mnist-test"}
    assert datasets["training"].digest != datasets["eval"].digest
    assert datasets["training"].source == json.dumps({"uri": tiny_mnist.resolve().as_uri()})
    assert [c["name"] for c in json.loads(datasets["eval"].schema)["mlflow_colspec"]] == ["image", "label"]
    assert marker.read_text().startswith("hung at step 20 in rank 1")
    assert run.data.tags["resumed_from_epoch"] == "1"  # restarted from epoch 1's checkpoint, not from scratch
    assert run.data.tags["hang"].startswith("hang: no rank advanced for 1")  # 10 s, and at most an interval more
    assert "stuck: rank 1 (rank 0 at epoch 2 step 4 (step); rank 1 at epoch 2 step 4 (data))" in run.data.tags["hang"]
    assert "hang: no rank advanced" in proc.stdout  # the driver says what happened
    stacks = {a.path: a for a in client.list_artifacts(run_id, "hang")}
    assert {"hang/rank0.txt", "hang/rank1.txt"} <= set(stacks)
    stuck = open(client.download_artifacts(run_id, "hang/rank1.txt", str(tmp_path))).read()
    assert "in maybe_inject_hang" in stuck and "in barrier" in stuck  # the frame it blocks in
    # Goodput: the hang's 10 s and the restart are in the rest, each epoch's training counted once (epoch 2, begun
    # before the hang, trained again after it); the start-up counts the driver's part after the run's creation; the
    # final model is its logging (the epochs were evaluated on the test split: no held-out scoring); the parts add
    # up to the wall time.
    metrics = client.get_run(run_id).data.metrics
    parts = [metrics[f"goodput.{part}_s"] for part in ("training", "epoch_end", "startup", "final", "other")]
    assert sum(parts) == pytest.approx(metrics["goodput.wall_s"])
    assert metrics["goodput.other_s"] >= 10 and min(parts) > 0
    assert 0 < metrics["startup.driver_before_run_s"] < metrics["startup.driver_s"]
    assert metrics["goodput.startup_s"] == pytest.approx(
        metrics["startup.driver_s"] - metrics["startup.driver_before_run_s"]
        + sum(metrics[f"startup.{part}_s"] for part in ("workers", "data", "model")))
    assert metrics["goodput.final_s"] == metrics["final_model.log_s"] and "final_model.test_s" not in metrics
    epoch_times = client.get_metric_history(run_id, "epoch_time_s")
    assert metrics["goodput.training_s"] == pytest.approx(sum(m.value for m in epoch_times))
    assert metrics["goodput"] == pytest.approx(metrics["goodput.training_s"] / metrics["goodput.wall_s"])
    assert "goodput " in proc.stdout and metrics["tflops_per_rank"] > 0 and "mfu" not in metrics  # CPUs: no peak
    assert float(run.data.tags["model.flops_per_sample"]) == 2 * 2 * 784 * 64 + 3 * 2 * 64 * 10  # the MLP, counted
    # The preflight over the process group (one node here: no node pairs), measured again at the restart
    assert metrics["preflight.allreduce_latency_ms"] > 0 and metrics["preflight.allreduce_bus_gb_per_s"] > 0
    for rank in (0, 1):  # every rank's times per step (contract/stragglers.py)
        assert metrics[f"rank{rank}.step_time_ms"] > metrics[f"rank{rank}.forward_ms"] > 0
        assert metrics[f"rank{rank}.data_wait_ms"] >= 0
    for name in EPOCH_METRICS:
        assert metric_steps(client, run_id, name) == [1, 2, 3], name  # every epoch exactly once
    losses = [m.value for m in sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)]
    assert losses[-1] < losses[0]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert "config.yaml" in artifacts
    assert [a.path for a in client.list_artifacts(run_id, "profile")] == ["profile/trace_rank0.json"]
    board = {a.path.split("/")[1].split(".")[0] for a in client.list_artifacts(run_id, "tensorboard")}
    assert board == {"events"}  # an event file per attempt of rank 0 (contents: tests/unit/test_tracking_spool.py)
    for node in ("driver", "rank0"):  # MLflow's system metrics of both processes, one sample a second
        memory = client.get_metric_history(run_id, f"system/{node}/system_memory_usage_megabytes")
        assert len(memory) >= 2 and all(m.value > 0 for m in memory), node
        assert len({m.step for m in memory}) == len(memory), node  # rank 0's restart continued the steps

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
    # The logged model is the best epoch's by test_accuracy (ties: the later epoch), from the checkpoint kept for it
    # beside Ray Train's last ones; the last checkpoint holds the final weights.
    accuracy = {m.step: m.value for m in client.get_metric_history(run_id, "test_accuracy")}
    best = max((value, epoch) for epoch, value in accuracy.items())[1]
    assert run.data.tags["final_model_epoch"] == str(best)
    assert {m.key: m.value for m in models[0].metrics}["test_accuracy"] == accuracy[best]  # linked to its epoch
    folders = [p for p in (tmp_path / "ray").glob("run-*/checkpoint_*") if p.is_dir()]
    folders += list((tmp_path / "ray").glob(f"run-*/{BEST_CHECKPOINT}"))
    kept = {json.loads((p / "train_state.json").read_text())["epoch"]:
            torch.load(p / "state.pt", weights_only=False)["model"] for p in folders}
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, kept[best][key], rtol=0, atol=0)
        torch.testing.assert_close(kept[3][key], rank0[key], rtol=0, atol=0)

    [version] = client.search_model_versions(f"name = '{registered}'")
    assert version.run_id == run_id and version.tags["training_run_id"] == run_id
    assert client.get_run(run_id).data.tags["registered_model"] == f"{registered}/{version.version}"
    page = f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    check_console(proc.stdout + proc.stderr, run_id, best, f"models:/{registered}/{version.version}",
                  tmp_path / "ray" / f"run-{run_id}", page)
    client.set_registered_model_alias(registered, "champion", version.version)
    check_evaluation(client, run_id, f"models:/{registered}@champion", model, accuracy[best], tiny_mnist,
                     pipeline_env(mlflow_server, ray_head), tmp_path)


def check_console(output: str, run_id: str, best: int, model: str, checkpoints: Path, page: str) -> None:
    """What the user reads: the epoch lines without Ray's per-report and data-sampling lines (`run.verbose` is
    off), then the run's summary block, which says what MLflow holds, then `mlflow_run_id=`."""
    assert "Reporting training result" not in output and "Parquet dataset sampling" not in output
    assert "epoch 3/3: train_loss" in output
    lines = output.splitlines()
    start, end = lines.index("--- run ---"), lines.index(f"mlflow_run_id={run_id}")
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines[start + 1:end])
    assert rows["status"] == "FINISHED" and rows["run"].startswith(run_id)
    assert rows["best epoch"].startswith(f"{best}: test_accuracy ")
    assert rows["model"].startswith(f"{model}  ") and rows["checkpoints"] == str(checkpoints)
    assert checkpoints.is_dir() and rows["MLflow UI"] == page


def inputs_by_context(run) -> dict:
    """The run's MLflow dataset inputs by their `mlflow.data.context` tag."""
    return {next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset
            for i in run.inputs.dataset_inputs}


def check_evaluation(client: MlflowClient, run_id: str, model_uri: str, model: torch.nn.Module, accuracy: float,
                     data: Path, env: dict[str, str], tmp_path: Path) -> None:
    """`pipelines.evaluate model=<model_uri>` on the Ray head: the training run's data and test split, scored by
    Ray Data actors holding the logged model, in an evaluation run linked to the training run. Its loss is the
    logged model's own on the split (float64 reference); its accuracy the training run's at the logged epoch."""
    evaluation = client.get_run(evaluate_ok(model_uri, env)[1])
    assert evaluation.info.status == "FINISHED"
    assert evaluation.data.tags["training_run_id"] == evaluation.data.params["training_run_id"] == run_id
    assert evaluation.info.experiment_id == client.get_run(run_id).info.experiment_id
    # the same split of the same data as the training run's evaluation: the same MLflow dataset
    trained_on = inputs_by_context(client.get_run(run_id))["eval"]
    assert inputs_by_context(evaluation)["evaluation"].digest == trained_on.digest
    assert evaluation.data.tags["mlflow.source.name"] == "pipelines.evaluate"
    features, labels = read_split(data, "test")
    with torch.no_grad():
        loss = F.cross_entropy(model(torch.from_numpy(features)).double(), torch.from_numpy(labels))
    metrics = evaluation.data.metrics
    assert metrics["test_rows"] == len(labels)
    torch.testing.assert_close(torch.tensor(metrics["test_loss"], dtype=torch.float64), loss, rtol=1e-5, atol=1e-7)
    assert abs(metrics["test_accuracy"] - accuracy) <= 1 / len(labels)  # float32 in another batching: 1 row at most
    folder = client.download_artifacts(evaluation.info.run_id, "", str(tmp_path))
    confusion = np.loadtxt(f"{folder}/confusion_matrix.csv", delimiter=",", dtype=np.int64)
    assert confusion.shape == (10, 10) and confusion.sum() == len(labels)
    assert confusion.trace() == round(metrics["test_accuracy"] * len(labels))
    assert (Path(folder) / "confusion_matrix.png").stat().st_size > 1000


def test_a_run_the_cluster_can_never_hold_exits_2_before_opening_a_run(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """The session's cluster has one node of 6 CPUs: 8 one-thread workers (an elastic run's fewest too), or 2
    workers on distinct nodes, would wait forever in Ray Train; the driver says so once connected, before any MLflow
    run exists."""
    env = pipeline_env(mlflow_server, ray_head)
    experiment = f"never-fits-{tmp_path.name}"
    base = [f"data.path={tiny_mnist}", f"run.experiment={experiment}", *TINY]
    too_many = run_pipeline([*base, "trainer.num_workers=8"], env)
    assert too_many.returncode == 2, too_many.stderr[-3000:]
    assert too_many.stderr.strip().splitlines()[-1] == (
        "error: trainer.num_workers: 8 workers need 8 CPUs and 0 GPUs, the Ray cluster has 6 CPUs and 0 GPUs")
    elastic = run_pipeline([*base, "trainer.num_workers=9", "trainer.min_workers=8", "trainer.batch_size=8",
                            "data.cache_in_worker=false"], env)  # an elastic run needs room for its fewest
    assert elastic.returncode == 2, elastic.stderr[-3000:]
    assert elastic.stderr.strip().splitlines()[-1] == (
        "error: trainer.min_workers: 8 workers need 8 CPUs and 0 GPUs, the Ray cluster has 6 CPUs and 0 GPUs")
    spread = run_pipeline([*base, "trainer.placement_strategy=STRICT_SPREAD"], env)
    assert spread.returncode == 2
    assert spread.stderr.strip().splitlines()[-1] == ("error: trainer.placement_strategy: STRICT_SPREAD puts each "
                                                      "of the 2 workers on its own node, the Ray cluster has 1")
    assert MlflowClient(mlflow_server).get_experiment_by_name(experiment) is None


def test_a_worker_the_others_cannot_reach_fails_the_run_at_once(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """The preflight gives rank 0 an address of rank 1 that routes nowhere (TEST-NET-1): before the process group
    is made (which would wait `fault.collective_timeout_s` for it), the run fails with one line naming rank 1 and
    its address, FAILED in MLflow. Rank 1's node is the head's: never left out (tests/slurm leaves one out)."""
    proc = run_pipeline([f"data.path={tiny_mnist}", "trainer.epochs=1", f"run.storage_path={tmp_path / 'ray'}",
                         "run.preflight=true", "run.preflight_timeout_s=5", "run.preflight_leave_out=true",
                         "fault.inject_unreachable_rank=1", *TINY],
                        pipeline_env(mlflow_server, ray_head))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"error: training failed: RuntimeError: preflight: workers cannot reach each other: "
                    r"rank 1 at 192\.0\.2\.1:\d+ from rank 0 \(", error), error
    run = MlflowClient(mlflow_server).get_run(run_id_from(proc.stdout))
    assert run.info.status == "FAILED" and "train_loss" not in run.data.metrics


def test_a_run_whose_loss_is_no_number_fails_without_a_model(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """A learning rate of 1e30 blows the weights up in the first steps: the run fails with one line naming where,
    is FAILED in MLflow, logs no model, and keeps no checkpoint of the broken state (the first epoch diverged)."""
    proc = run_pipeline([f"data.path={tiny_mnist}", "trainer.lr=1e30", "trainer.epochs=2", "trainer.num_workers=1",
                         f"run.storage_path={tmp_path / 'ray'}", *TINY], pipeline_env(mlflow_server, ray_head))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: training failed: TrainingDiverged: the loss is not a finite number from epoch 1 ")
    assert "the last finite checkpoint: none (the first epoch diverged)" in error
    run_id = run_id_from(proc.stdout)
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and "train_loss" not in run.data.metrics
    mlflow.set_tracking_uri(mlflow_server)
    assert not mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list",
                                           filter_string=f"source_run_id = '{run_id}'")
    assert not list((tmp_path / "ray").glob("run-*/checkpoint_*"))


def test_a_tracking_server_away_at_the_end_loses_nothing_and_the_replay_finishes_the_run(tmp_path, tiny_imdb,
                                                                                         ray_head):
    """The run's MLflow server goes away once epoch 1 is logged and is still away when training ends: the workers
    train on and spool what the server misses, the driver exits 1 with one line naming the spool and the replay
    command, and the replay, with the server back, leaves the run as if nothing happened: every epoch once, the
    model, FINISHED. Also the end-to-end run of FSDP, with two pipeline stages (BERT tiny on IMDb): its sharded
    checkpoints, reported by both workers and merged by Ray Train, restore the workers after a failure at epoch 2
    and give the final model (exported dense); a checkpoint inside each epoch is written in the background (DCP's
    `async_save`, uploaded once written)."""
    base, port = tmp_path / "mlflow", free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(base, port)
    cmd = [sys.executable, "-m", "pipelines.train", "trainer=fsdp", "data=imdb", "model=bert_tiny",
           f"data.path={tiny_imdb}", "trainer.pp=2", "trainer.batch_size=32", "trainer.epochs=3",
           f"run.storage_path={tmp_path / 'ray'}", "fault.inject_at_epoch=2", "run.checkpoint_every_n_steps=2",
           f"fault.inject_marker={tmp_path / 'failed-once'}", "trainer.threads_per_worker=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=pipeline_env(uri, ray_head), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        run_id = next(line.split()[2] for line in proc.stdout if line.startswith("MLflow run "))
        client = MlflowClient(uri)
        wait_until(lambda: client.get_metric_history(run_id, "train_loss"), 300, "the first epoch")
        stop_mlflow_server(server)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = tmp_path / "ray" / f"run-{run_id}" / "mlflow_spool"
    assert proc.returncode == 1, err[-3000:]
    assert (f"error: MLflow tracking server {uri} is unreachable; {spooled(folder)} unsent record(s) of run {run_id} "
            f"and its final model are kept in {folder}: once the server is back, replay them with "
            f"`rtp replay {folder}`") in err.splitlines()  # (Ray's worker logs may follow it)
    assert spooled(folder) > 0 and (folder / FINAL_FILE).is_file()

    server = start_mlflow_server(base, port)  # back, on the same address and store
    try:
        replay = subprocess.run([sys.executable, "-m", "pipelines.replay", str(folder)], cwd=ROOT, text=True,
                                capture_output=True, env=pipeline_env(uri), timeout=300)
        assert replay.returncode == 0, replay.stderr[-3000:]
        assert run_id_from(replay.stdout) == run_id
        model_uri = check_finished_run(client, run_id, "fsdp", 3)  # each epoch's metrics once, the model logged
        run = client.get_run(run_id)
        # final_model_epoch: the driver's tag, sent through final.json
        assert {"rank0.node", "rank1.node", "final_model_epoch"} <= set(run.data.tags)
        assert list(folder.glob("*.json")) == []
        assert (tmp_path / "failed-once").exists() and run.data.tags["resumed_from_epoch"] == "1"
        checkpoint = max(p for p in (tmp_path / "ray" / f"run-{run_id}").glob("checkpoint_*") if p.is_dir())
        assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        metrics, model = run.data.metrics, mlflow.pytorch.load_model(model_uri)
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Each worker holds its stage: one block each, the embeddings on the first, the classifier on the last.
        assert metrics["rank0.param_bytes"] + metrics["rank1.param_bytes"] == dense_bytes
        assert metrics["rank0.param_bytes"] > metrics["rank1.param_bytes"] > 0
    finally:
        stop_mlflow_server(server)


def test_a_run_waiting_for_a_busy_cluster_ctrl_c_kills_it_and_the_timeout_fails_it(tmp_path, tiny_mnist,
                                                                                     mlflow_server, ray_head):
    """Another job holds 5 of the session cluster's 6 CPUs, so a run's 2 workers cannot start. Ctrl-C while Ray
    Train waits for them: it aborts the run within seconds, the driver exits 1 with one line, and the MLflow run is
    KILLED with an `interrupted` tag (not FAILED, not left RUNNING). `fault.resource_timeout_s`: the run fails
    (FAILED, exit 1) with one line naming what it needed and what is free; with every CPU held, the driver's read
    of the shards (Ray Data's tasks) gives up after the timeout too."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    env, client = pipeline_env(mlflow_server, ray_head), MlflowClient(mlflow_server)
    args = [f"data.path={tiny_mnist}", "trainer.epochs=1", f"run.storage_path={tmp_path / 'ray'}", *TINY]
    ray_init_on(ray_head, log_to_driver=False)
    try:
        other_job = placement_group([{"CPU": 5}])
        ray.get(other_job.ready(), timeout=120)
        # verbose: Ray Train's line saying it waits for the workers' resources is one of Ray's INFO lines
        with interruptible("pipelines.train", [*args, "run.verbose=true"], env) as waiting:
            interrupted = next(line.split()[2] for line in waiting.stdout if line.startswith("MLflow run "))
            # Ctrl-C while Ray Train's controller waits for the CPUs (it would not take an abort before its 600 s
            # resource timeout: pipelines/fit.py fit_in_thread)
            next(line for line in waiting.stderr if "Attempting to start training worker group" in line)
            _, err = ctrl_c(waiting, 120)
        timed_out = run_pipeline([*args, "fault.resource_timeout_s=5"], env)
        remove_placement_group(other_job)
        # Every CPU held: each step of the driver's own Ray Data work waits as long as the timeout says: listing
        # the files, and reading them.
        all_cpus = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
        ray.get(all_cpus.ready(), timeout=120)
        splits = {"train": "train", "eval": "test"}
        with pytest.raises(ResourceWait) as unlisted:
            within(3, "list the shards", lambda: parquet_datasets(str(tiny_mnist), splits, "off"))
        remove_placement_group(all_cpus)
        datasets = parquet_datasets(str(tiny_mnist), splits, "off")
        all_cpus = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
        ray.get(all_cpus.ready(), timeout=120)
        reading = Materializing(datasets)
        with pytest.raises(ResourceWait) as unread:
            reading.result(timeout_s=3)
        remove_placement_group(all_cpus)
        assert set(reading.result()) == {"train", "eval"}  # with the CPUs free, the reads go on to the end
    finally:
        ray.shutdown()
    for error, what in ((unlisted, "list the shards"), (unread, "read the train and eval shards")):
        assert re.fullmatch(rf"Ray Data did not {what} within fault.resource_timeout_s=3 s: its (read )?tasks wait "
                            r"for free CPUs \(0 of the cluster's \d+ CPUs free now\); other jobs hold the rest "
                            r"\(0: wait\)", str(error.value)), str(error.value)
    assert waiting.returncode == 1, err[-3000:]
    assert "error: interrupted (SIGINT); the MLflow run is KILLED" in err.splitlines()
    run = client.get_run(interrupted)
    assert run.info.status == "KILLED" and run.data.tags["interrupted"] == "SIGINT" and "error" not in run.data.tags

    assert timed_out.returncode == 1, timed_out.stderr[-3000:]
    assert re.fullmatch(r"error: training failed: RuntimeError: fault.resource_timeout_s: the Ray cluster did not "
                        r"free 2 CPUs and 0 GPUs for 2 workers within 5 s \(free now: [01] CPUs, 0 GPUs\); wait for "
                        r"other jobs, or raise the timeout \(0: wait forever\); the MLflow run is FAILED",
                        timed_out.stderr.strip().splitlines()[-1]), timed_out.stderr[-2000:]
    failed = client.get_run(run_id_from(timed_out.stdout))  # failed in fit: FAILED, with the error as a tag
    assert failed.info.status == "FAILED" and "did not free 2 CPUs" in failed.data.tags["error"]
