"""cluster/slurm/ray-cluster.sbatch on a real 2-node Slurm (cluster/dev/slurm-local.sh): the data-parallel backends with
one worker on each node (ddp in a preempted sweep requeued and continued; tf_mwms and horovod, restarting after a
failure, in two concurrent jobs, one of them finding its port block taken), a node the preflight leaves out (of an
elastic run and of its requeue, of a run of a fixed size), a node lost from a --no-kill job, a node that never joins,
and a port lock held by another process or owned by another user. (A training run's stop and resume, exit code 3, is the
same protocol: tests/integration/test_stop_resume.py runs it through the driver. TP's collectives run over the same Gloo
process groups as DDP's: tests/integration and tests/parallel cover it.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

from tests.conftest import check_step_losses_are_global, prepared_mnist, wait_until
from tests.support.horovod_checks import BATCHES_PER_EPOCH, check_replicas_identical, init_log, optimizer_steps
from tests.slurm.conftest import (REPO, elapsed_s, job_info, job_output, ray_leftovers, sbatch, skip_requeue_delay,
                                 wait_gone, wait_job)

pytestmark = pytest.mark.slow

NODE_ADDRS = {"127.0.0.2", "127.0.0.3"}
EPOCH_METRICS = ("train_loss", "test_accuracy", "samples_per_s")


# A user's plugin module: a model of its own (the built-in MLP's builders under another name and config).
SITE_MODELS = """
from dataclasses import dataclass, field

from contract.registry import ModelSpec, register_model


@dataclass
class SiteMLPConfig:
    name: str = "site_mlp"
    hidden: list = field(default_factory=lambda: [64])
    dropout: float = 0.0


register_model(ModelSpec("site_mlp", SiteMLPConfig, "a site's MLP", inputs=("image",),
                         torch="trainers.models.mlp_cnn:build_mlp", keras="trainers.models.keras_models:build_mlp"))
"""


def ddp_command(data: Path, *overrides: str, backend: str = "ddp") -> list[str]:
    # One worker per node (STRICT_SPREAD), one thread each: both Slurm nodes really take part.
    return ["python", "-m", "pipelines.train", f"trainer={backend}", "trainer.num_workers=2",
            "trainer.placement_strategy=STRICT_SPREAD", f"data.path={data}", "trainer.batch_size=32",
            "data.cache_in_worker=true", *overrides]


def local_store(out_dir: Path) -> mlflow.MlflowClient:
    """The MLflow store the job's own server wrote (sqlite on the shared folder), read after the job."""
    return mlflow.MlflowClient(f"sqlite:///{out_dir}/mlflow/mlflow.db")


def assert_each_epoch_once(client: mlflow.MlflowClient, run_id: str, epochs: int) -> None:
    for metric in EPOCH_METRICS:
        steps = sorted(m.step for m in client.get_metric_history(run_id, metric))
        assert steps == list(range(1, epochs + 1)), (metric, steps)


def assert_spread_run(client: mlflow.MlflowClient, run_id: str, epochs: int) -> None:
    """Finished, one worker per Slurm node, every epoch logged once."""
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {run.data.tags["rank0.node"], run.data.tags["rank1.node"]} == NODE_ADDRS  # one worker per node
    assert_each_epoch_once(client, run_id, epochs)


def test_preempted_sweep_requeues_and_continues_into_the_same_runs(slurm, tmp_path, monkeypatch):
    """A sweep (a DDP trial on 2 workers spread over the nodes) preempted after its trial's first epoch: the Slurm
    script asks it to stop, the trial checkpoints mid-run and the sweep exits 3, the job requeues itself, and the
    requeued sweep continues the same MLflow parent and child run from that checkpoint, each epoch logged once. The
    job's own MLflow server refuses requests without the job's credential."""
    out, data = tmp_path / "slurm", prepared_mnist(tmp_path / "mnist", 8192)
    # 8192 rows / 2 workers / 8 per batch = 512 steps an epoch (about 2.5 s here), 4 epochs: the stop, asked once
    # the first epoch is in MLflow, lands seconds before the trial could end (the workers check for it every 10
    # steps). A trial that ends first leaves the sweep nothing to continue: it completes and is never requeued
    # (seen in CI with 32 steps an epoch).
    grid = "sweep.grid=[{trainer:[ddp],trainer.num_workers:[2]}]"
    command = ["python", "-m", "pipelines.sweep", "sweep=mnist_backends", grid, "sweep.scheduler=grid",
               f"data.path={data}", "trainer.epochs=4", "trainer.batch_size=8",
               "trainer.placement_strategy=STRICT_SPREAD", "model.hidden=[32]"]
    job = sbatch(slurm, out, command)
    sweep_file = out / f"job-{job}" / "resume" / "mlflow_sweep.json"
    wait_until(sweep_file.exists, 600, "the sweep to open its MLflow runs")
    env_file = out / f"job-{job}" / "cluster.env"
    wait_until(env_file.exists, 60, "cluster.env")
    exported = dict(word.split("=", 1) for word in env_file.read_text().split() if "=" in word)
    assert env_file.stat().st_mode & 0o077 == 0  # it holds the job's MLflow credential
    uri = exported["MLFLOW_TRACKING_URI"]
    with pytest.raises(urllib.error.HTTPError) as refused:  # the job's MLflow server wants the job's credential
        urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert refused.value.code == 401
    wrong = subprocess.run([sys.executable, "-m", "pipelines.train", f"data.path={data}"], cwd=REPO, text=True,
                           capture_output=True, env={**slurm, "MLFLOW_TRACKING_URI": uri, "MLFLOW_TRACKING_USERNAME":
                                                     "intruder", "MLFLOW_TRACKING_PASSWORD": "guess"})
    assert wrong.returncode == 2 and wrong.stderr.strip().startswith(
        f"error: MLflow tracking server {uri} refused our credentials (HTTP 401)"), wrong.stderr
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, exported[name])
    live = mlflow.MlflowClient(uri)
    parent_id = json.loads(sweep_file.read_text())["parent"]
    experiment = live.get_run(parent_id).info.experiment_id

    def trial_runs() -> list:  # each trial opens its child run when it starts
        return live.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    wait_until(lambda: any(live.get_metric_history(r.info.run_id, "train_loss") for r in trial_runs()),
               600, "a trial's first epoch to be logged")

    # What `#SBATCH --signal=B:TERM@...` does before the time limit: TERM to the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm, check=True)
    skip_requeue_delay(slurm, job, 600)
    info = wait_job(slurm, job, 900, restarts=1)
    log = job_output(out, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "requeueing job" in log and "pipeline exit code 0" in log

    client = local_store(out)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    recorded = json.loads(sweep_file.read_text())  # the sweep's runs, as the requeued sweep recorded them
    assert recorded["parent"] == parent_id and len(recorded["children"]) == 1
    assert {r.info.run_id for r in runs} == {recorded["parent"], *recorded["children"].values()}  # no new runs
    parent = client.get_run(recorded["parent"])
    assert parent.info.status == "FINISHED" and parent.data.tags["attempts"] == "2"
    assert parent.data.tags["preempted_at"].endswith("trials unfinished")
    assert parent.data.params["cluster.nodes"] == "2" and parent.data.metrics["trials_failed"] == 0
    [child] = [client.get_run(run_id) for run_id in recorded["children"].values()]
    assert_spread_run(client, child.info.run_id, 4)
    assert child.data.tags["attempts"] == "2"  # continued, not restarted
    # The preflight, on by default under Slurm: the link between the two nodes measured
    links = [key.split(".", 1)[1].rsplit(".", 1)[0] for key in child.data.metrics
             if key.startswith("preflight.") and key.endswith(".latency_ms") and "-" in key]
    assert [sorted(link.split("-")) for link in links] == [sorted(NODE_ADDRS)], links
    stop = re.fullmatch(r"epoch ([234]) step (\d+)", child.data.tags["preempted_at"])  # mid-trial, as recorded
    assert stop, child.data.tags["preempted_at"]
    assert child.data.tags["resumed_from_epoch"] == str(int(stop[1]) - 1)  # from the checkpoint of the stop
    wait_gone(job)


def live_client(out: Path, job: str, monkeypatch) -> mlflow.MlflowClient:
    """A client of the job's own MLflow server while the job runs, with the job's credential (cluster.env)."""
    env_file = out / f"job-{job}" / "cluster.env"
    wait_until(env_file.exists, 600, "cluster.env")
    exported = dict(word.split("=", 1) for word in env_file.read_text().split() if "=" in word)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, exported[name])
    return mlflow.MlflowClient(exported["MLFLOW_TRACKING_URI"])


def test_a_node_the_preflight_finds_at_fault_is_left_out_of_the_run_and_of_the_requeue(slurm, tmp_path,
                                                                                        monkeypatch):
    """An elastic ddp run (2 workers, down to 1) on two nodes, each worker taking 2 of a node's 3 CPUs, so one on
    each. The preflight gives the others an address of n2's worker that routes nowhere: n2 is left out (its Ray
    stopped), and the run starts again on n1 alone, without a requeue, and trains. Preempted, the job requeues
    itself with n2 in its ExcNodeList (as `--exclude`): in this 2-node cluster it then waits for a node."""
    out, data = tmp_path / "slurm", prepared_mnist(tmp_path / "mnist", 8192)
    # 8192 rows in global batches of 16: 512 steps an epoch, 4 epochs (as the preempted sweep's, above)
    command = ["python", "-m", "pipelines.train", "trainer=ddp", "trainer.num_workers=2", "trainer.min_workers=1",
               "trainer.threads_per_worker=2", "trainer.batch_size=8", "trainer.epochs=4", "model.hidden=[32]",
               f"data.path={data}", "data.cache_in_worker=false", "run.checkpoint_every_n_steps=100",
               "run.preflight_timeout_s=5", "fault.inject_unreachable_node=127.0.0.3"]
    job = sbatch(slurm, out, command, sbatch_args=["--cpus-per-task=3"])
    live = live_client(out, job, monkeypatch)
    run_file = out / f"job-{job}" / "resume" / "mlflow_run_id"
    wait_until(run_file.exists, 600, "the run to open its MLflow run")
    run_id = run_file.read_text().strip()
    wait_until(lambda: live.get_metric_history(run_id, "train_loss"), 600, "the first epoch to be logged")
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm, check=True)
    try:
        def requeued() -> bool:  # excluding n2, its old allocation released (COMPLETING until then)
            info = job_info(slurm, job)
            return info.get("ExcNodeList") == "n2" and info.get("JobState") != "COMPLETING"
        wait_until(requeued, 600, "the job requeued without n2")
        info = job_info(slurm, job)
    finally:
        subprocess.run(["scancel", job], env=slurm)
    log = job_output(out, job)
    assert info["Restarts"] == "1" and info["JobState"] == "PENDING", log
    assert re.search(r"\npreflight left out node 127\.0\.0\.3: preflight: workers cannot reach each other: "
                     r"rank \d at 192\.0\.2\.1:\d+ from rank \d", log), log  # n2's rank: 0 or 1
    assert "the requeued job leaves out n2 (the preflight found them at fault)" in log
    assert "ray-node: worker on n2 (127.0.0.3) stopped" in (out / f"job-{job}" / "ray-workers.log").read_text()
    assert (out / f"job-{job}" / "left_out").read_text().split() == ["127.0.0.3"]

    client = local_store(out)
    run = client.get_run(run_id)
    assert run.data.tags["preflight.left_out"] == "127.0.0.3" and run.data.tags["workers"] == "1 from the start"
    assert run.data.tags["rank0.node"] == "127.0.0.2" and "preempted_at" in run.data.tags
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")][0] == 1  # it trained on n1 alone
    wait_gone(job)


def node_state(env: dict[str, str], node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", node], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out)).get("State", "")


def test_a_node_lost_from_a_no_kill_job_leaves_an_elastic_run_going_without_a_requeue(slurm, tmp_path, monkeypatch):
    """`sbatch --no-kill`: an elastic ddp run on two nodes (a worker of 2 threads on each, down to 1 worker) whose
    node n2 Slurm sets DOWN mid-run, as a failed node: Slurm keeps the job and ends its step on n2 (that node's
    Ray), Ray Train goes on with 1 worker on n1 from the last checkpoint, and the run finishes in the same job."""
    out, data = tmp_path / "slurm", prepared_mnist(tmp_path / "mnist", 8192)
    command = ["python", "-m", "pipelines.train", "trainer=ddp", "trainer.num_workers=2", "trainer.min_workers=1",
               "trainer.threads_per_worker=2", "trainer.batch_size=8", "trainer.epochs=3", "model.hidden=[32]",
               f"data.path={data}", "data.cache_in_worker=false", "run.checkpoint_every_n_steps=100",
               "fault.max_failures=2"]
    job = sbatch(slurm, out, command, sbatch_args=["--no-kill", "--cpus-per-task=3"])
    live = live_client(out, job, monkeypatch)
    run_file = out / f"job-{job}" / "resume" / "mlflow_run_id"
    wait_until(run_file.exists, 600, "the run to open its MLflow run")
    run_id = run_file.read_text().strip()
    wait_until(lambda: live.get_metric_history(run_id, "train_loss"), 600, "the first epoch to be logged")
    try:
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=test-lost-node"], env=slurm,
                       check=True)
        info = wait_job(slurm, job, 900)
    finally:  # n2 back in service for the next tests: RESUME, refused once Slurm returned it by itself (its
        # slurmd answering again, ReturnToService=2)
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], env=slurm, capture_output=True)
        wait_until(lambda: node_state(slurm, "n2") in ("IDLE", "MIXED", "ALLOCATED"), 300, "n2 back in service")
    log = job_output(out, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", log
    client = local_store(out)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED", log
    sizes = run.data.tags["workers"].split(",")
    assert sizes[0] == "2 from the start" and re.fullmatch(r"1 from epoch \d step \d+ \(shrunk from 2: workers "
                                                            r"lost\)", sizes[1]), sizes
    assert_each_epoch_once(client, run_id, 3)
    # n2's step was killed outright: its Ray temp dir stays on the node (removed when the job next starts there)
    shutil.rmtree(f"/tmp/ray-slurm-{job}-n2", ignore_errors=True)
    wait_gone(job)


def test_a_run_of_a_fixed_size_leaves_a_node_at_fault_out_where_the_others_can_hold_it(slurm, tiny_mnist, tmp_path):
    """A ddp run of 2 one-thread workers spread over two nodes of 3 CPUs, n2's worker unreachable: Ray Train gives up
    on that start (a run of a fixed size does not retry its starts), the driver fits again on n1 alone, which holds
    both workers, and the run finishes; the job says what to exclude next time."""
    out = tmp_path / "slurm"
    command = ["python", "-m", "pipelines.train", "trainer=ddp", "trainer.num_workers=2",
               "trainer.placement_strategy=SPREAD", f"data.path={tiny_mnist}", "trainer.batch_size=32",
               "trainer.epochs=1", "model.hidden=[32]", "run.preflight_timeout_s=5",
               "fault.inject_unreachable_node=127.0.0.3"]
    job = sbatch(slurm, out, command, sbatch_args=["--cpus-per-task=3"])
    info = wait_job(slurm, job, 900)
    log = job_output(out, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "the preflight left nodes out; starting the workers again without them" in log
    assert "the preflight left out n2: sbatch --exclude=n2 leaves them out of the next job" in log
    client = local_store(out)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.tags["preflight.left_out"] == "127.0.0.3"
    assert {run.data.tags["rank0.node"], run.data.tags["rank1.node"]} == {"127.0.0.2"}
    assert_each_epoch_once(client, run.info.run_id, 1)
    wait_gone(job)


def free_block_base(job: int) -> int:
    """The base port the sbatch script prefers for a job (cluster/slurm/ray_slurm.py, default first port)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_slurm", REPO / "cluster" / "slurm" / "ray_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return 20000 + job % module.block_count(20000, 400) * 400


def hold_a_port(base: int, size: int = 400) -> socket.socket | None:
    """A listener on the first port of block [base, base+size) that is free on n1 (the head node). On a busy
    machine some ports of the block may be in use already (other Ray clusters, outgoing connections); any held
    port makes the block busy for the job. None: every port is in use, so the block is busy without us."""
    for port in range(base, base + size):
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.2", port))
            holder.listen()
            return holder
        except OSError:
            holder.close()
    return None


def test_two_concurrent_jobs_do_not_interfere(slurm, tiny_mnist, tmp_path, mlflow_server):
    """Two jobs released at the same moment, each a backend whose collectives then cross the node boundary:
    tf_mwms (custom loop, RING) and horovod torch. The first job finds a port of its preferred block held (a
    listener the test holds) and moves on, typically to the second job's preferred block, which both jobs then
    find free at once: the host's port lock must give it to one of them only. The site's MLflow server
    (MLFLOW_TRACKING_URI) this time; each job brings its own Ray cluster. The tf_mwms job logs every step's loss,
    the global batch's mean across the nodes.

    The horovod job uses fp16 compression and 2 backward passes per step, and its rank 1 fails at epoch 2: Ray
    Train restarts the worker group from epoch 1's checkpoint, and the new processes do a new Gloo rendezvous
    across the nodes and train on. Identical replicas, each epoch once in MLflow, the optimizer stepped once per
    2 batches (its counter restored across the restart). It is submitted from a user's project folder on the
    shared filesystem, and trains that project's model: its plugin module is imported by the driver from the
    working directory, and by the workers on both nodes (the restarted ones too) from the folder the driver
    found it in."""
    out, marker, params = tmp_path / "slurm", tmp_path / "failed-once", tmp_path / "params"
    project = tmp_path / "project"
    project.mkdir()
    (project / "site_models.py").write_text(SITE_MODELS)
    site = {"MLFLOW_TRACKING_URI": mlflow_server}
    experiment = f"concurrent-{tmp_path.name}"
    named = (f"run.experiment={experiment}", "model.hidden=[32]")
    commands = [ddp_command(tiny_mnist, *named, "trainer.epochs=1", "run.name=job0", "trainer.tf_loop=custom",
                            "trainer.tf_communication=ring", "trainer.log_every_n_steps=1", backend="tf_mwms"),
                ddp_command(tiny_mnist, *named, "trainer.epochs=2", "run.name=job1", "trainer.compression=fp16",
                            "trainer.grad_accum=2", "fault.max_failures=1", "fault.inject_at_epoch=2",
                            f"fault.inject_marker={marker}", f"run.dump_params_dir={params}",
                            "plugins=[site_models]", "model=site_mlp", backend="horovod")]
    jobs = [sbatch(slurm, out, command, sbatch_args=["--hold"], extra_env=site, cwd=folder)
            for command, folder in zip(commands, (REPO, project))]
    preferred = free_block_base(int(jobs[0]))
    holder = hold_a_port(preferred)
    try:
        subprocess.run(["scontrol", "release", ",".join(jobs)], env=slurm, check=True)
        infos = [wait_job(slurm, job, 900) for job in jobs]
    finally:
        if holder is not None:
            holder.close()
    logs = [job_output(out, job) for job in jobs]
    for info, log in zip(infos, logs):
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
        assert "all 2 nodes joined" in log
    bases = [int(log.split(", ports ", 1)[1].split("..", 1)[0]) for log in logs]
    # A later block (not always the next: ports in use by anything, e.g. outgoing connections, also count).
    assert bases[0] != preferred and (bases[0] - 20000) % 400 == 0, bases
    assert bases[0] != bases[1]
    # They really ran at the same time (each holds 2 of the 4 CPUs per node).
    assert infos[1]["StartTime"] <= infos[0]["EndTime"] and infos[0]["StartTime"] <= infos[1]["EndTime"]

    client = mlflow.MlflowClient(mlflow_server)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])}
    assert sorted(runs) == ["job0", "job1"]
    assert_spread_run(client, runs["job0"].info.run_id, 1)
    check_step_losses_are_global(client, runs["job0"].info.run_id, epochs=1)  # logged as the step returns it
    horovod = runs["job1"]
    assert_spread_run(client, horovod.info.run_id, 2)
    assert marker.read_text().startswith("failed at epoch 2 in rank 1")
    assert horovod.data.params["cluster.nodes"] == "2" and horovod.data.tags["resumed_from_epoch"] == "1"
    assert horovod.data.params["model.name"] == "site_mlp"  # the project's own model
    assert [m.value > 0 for m in client.get_metric_history(horovod.info.run_id, "cluster_startup_s")] == [True]
    check_replicas_identical(params, "torch")
    steps = optimizer_steps(out / "ray-results", "torch", run_id=horovod.info.run_id)
    assert steps == 2 * BATCHES_PER_EPOCH // 2  # 2 epochs, grad_accum=2
    attempts = init_log(params)
    assert len(attempts) == 4 and attempts[0]["rendezvous"] == attempts[1]["rendezvous"]
    assert not {a["pid"] for a in attempts[:2]} & {a["pid"] for a in attempts[2:]}  # new processes
    tokens = [(out / f"job-{job}" / "cluster.env").read_text() for job in jobs]
    assert tokens[0] != tokens[1]  # per-job secrets and addresses
    for job in jobs:
        wait_gone(job)
        assert not (out / f"job-{job}" / "ray_auth_token").exists()  # the job's secret is gone with it


def test_node_that_never_joins_fails_fast_and_releases_the_allocation(slurm, tiny_mnist, tmp_path):
    # A hung node: slurmd of n2 stopped (SIGSTOP). Slurm still allocates it, but the Ray worker step on it
    # never starts, so the job must give up after its join timeout, name the node, and end. The timeout counts
    # from the head being up, so the head (n1) is never among the missing however slowly it starts on a busy machine
    # (it has a limit of its own, RAY_SLURM_HEAD_TIMEOUT: tests/slurm/test_wait_nodes.py).
    pid = int(Path(os.path.dirname(slurm["SLURM_CONF"]), "slurmd-n2.pid").read_text())
    out = tmp_path / "slurm"
    os.kill(pid, signal.SIGSTOP)
    try:
        job = sbatch(slurm, out, ddp_command(tiny_mnist), extra_env={"RAY_SLURM_JOIN_TIMEOUT": "20"})
        wait_until(lambda: "did not join" in job_output(out, job), 300, "the join timeout")
    finally:
        os.kill(pid, signal.SIGCONT)
    info = wait_job(slurm, job, 300)
    log = job_output(out, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log
    assert "1 of 2 nodes did not join the Ray cluster within 20 s: n2 (127.0.0.3)" in log
    head_up = re.search(r"^ray-cluster: Ray head up after ([\d.]+) s; waiting up to 20 s for the other 1 node\(s\)$",
                        log, re.MULTILINE)
    assert head_up, log
    # Failed fast once the head was up (20 s, the teardown), not after a long default timeout.
    assert elapsed_s(info) < float(head_up[1]) + 100, (info, log)
    assert [line for line in log.splitlines() if "error" in line.lower()] == [
        "ray-cluster: error: 1 of 2 nodes did not join the Ray cluster within 20 s: n2 (127.0.0.3)"], log
    wait_until(lambda: job_info(slurm, job).get("JobState") != "COMPLETING", 120, "the allocation to be released")
    squeue = subprocess.run(["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True).stdout
    assert squeue.strip() == ""
    wait_gone(job)
    assert not ray_leftovers(job)


# Holds an exclusive flock on the file argv[1] until stdin closes.
HOLD_LOCK = ("import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
             "print('held', flush=True); sys.stdin.read()")


def test_a_port_lock_that_is_held_or_not_ours_fails_the_start_with_one_line(slurm, tiny_mnist, tmp_path):
    """The host's port lock (cluster/slurm/ray-cluster.sbatch) is the user's own file, waited for at most
    RAY_SLURM_PORT_LOCK_TIMEOUT: held by another process all that time, the job fails with one line naming that
    process; a lock file of another user is refused, not waited for."""
    out, held, foreign = tmp_path / "slurm", tmp_path / "held.lock", tmp_path / "foreign.lock"
    foreign.touch()
    os.chown(foreign, 65534, 65534)  # nobody's
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(held)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        jobs = [sbatch(slurm, out, ddp_command(tiny_mnist), extra_env={"RAY_SLURM_PORT_LOCK": str(lock),
                                                                       "RAY_SLURM_PORT_LOCK_TIMEOUT": "2"})
                for lock in (held, foreign)]
        infos = [wait_job(slurm, job, 300) for job in jobs]  # ends while the lock is still held: the wait is bounded
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    errors = []
    for job, info in zip(jobs, infos):
        log = job_output(out, job)
        assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log
        errors.append([line for line in log.splitlines() if "error" in line.lower()])
    assert len(errors[0]) == 1 and re.fullmatch(
        rf"ray-cluster: error: the port lock {held} was held for over 2 s by pid {holder.pid} \(root: \S*python\S* -c "
        r"import fcntl.*\); end it, or raise RAY_SLURM_PORT_LOCK_TIMEOUT", errors[0][0]), errors[0]
    assert errors[1] == [f"ray-cluster: error: the port lock {foreign} is not a file of yours (owner: nobody): remove "
                         "it, or set RAY_SLURM_PORT_LOCK to a path of yours"]
    assert foreign.stat().st_uid == 65534  # left as it was
