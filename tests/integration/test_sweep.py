"""A real sweep (`sweep=smoke`: 2 trials of a tiny BERT on generated IMDb-format data, 5 rejected points)
submitted with `ray job submit` to a real Ray head, logged to a real MLflow server; everything checked by reading
MLflow back. Its trials are also the end-to-end runs of DDP on text (the model learns, the text metrics are
logged). A PBT sweep of two MNIST trials checks that a poor trial continues from the better trial's checkpoint,
and a random search of two under ASHA that the poor one is stopped early."""
from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from contract.metrics import EPOCH_METRICS, FIRST_EPOCH_METRICS, TEXT_METRICS
from contract.tracking import epoch_values
from pipelines.data.imdb import clean_text
from pipelines.data.raw_inputs import read_texts
from pipelines.data.shards import read_manifest
from pipelines.data.tokenize import Tokenise
from tests.conftest import ROOT, interruptible, pipeline_env

pytestmark = pytest.mark.slow
EXPECTED_TRIALS = {("ddp", "1", "1", "1"), ("ddp", "2", "1", "2")}


def submit_sweep(args: list[str], mlflow_server: str, ray_head: dict) -> subprocess.CompletedProcess:
    env = pipeline_env(mlflow_server, ray_head)
    runtime_env = {"excludes": ["/.venv", "/.git", "/data", "/outputs", "/mlflow.db", "/mlartifacts"],
                   "env_vars": {k: env[k] for k in ("MLFLOW_TRACKING_URI", "OMP_NUM_THREADS",
                                                    "RAY_DATA_DISABLE_PROGRESS_BARS")}}
    cmd = ["ray", "job", "submit", "--address", ray_head["RAY_DASHBOARD_ADDRESS"], "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--", "python", "-m", "pipelines.sweep", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def parent_id_from(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("mlflow_parent_run_id=")]
    assert lines, stdout[-4000:]
    return lines[-1].split("=", 1)[1].strip()


def history(client: MlflowClient, run_id: str, name: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]


def test_smoke_sweep_nests_runs_rejects_points_and_reports(tmp_path, tiny_imdb, mlflow_server, ray_head):
    marker = tmp_path / "failed-once"
    # fault.max_failures=0: the injected failure fails the Ray Train run, so Tune restarts the whole trial.
    proc = submit_sweep(["sweep=smoke", f"data.path={tiny_imdb}", f"run.storage_path={tmp_path / 'ray'}",
                         "fault.max_failures=0", "fault.inject_at_epoch=2", f"fault.inject_marker={marker}",
                         f"run.register_model=smoke-best-{tmp_path.name}"],
                        mlflow_server, ray_head)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    parent_id = parent_id_from(proc.stdout)
    assert "## Scaling report" in proc.stdout and "rejected #6" in proc.stdout

    client = MlflowClient(mlflow_server)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    metrics = parent.data.metrics
    assert (metrics["trials_valid"], metrics["trials_rejected"], metrics["trials_failed"]) == (2, 5, 0)
    assert parent.data.params["cluster.max_concurrent_trials"] == "1"  # 6 CPUs, 4 for a 2-worker trial
    assert {"rejected.json", "rejected.csv", "data_manifest.json", "tokenizer.json", "report"} <= {
        a.path for a in client.list_artifacts(parent_id)}

    rejected = json.loads(open(download(mlflow_server, parent_id, "rejected.json", tmp_path)).read())
    reasons = " | ".join(r["reason"] for r in rejected)
    assert len(rejected) == 5
    for expected in ("does not divide num_workers", "tp*dp=", "does not divide the model's heads=2",
                     "cluster: needs 10 CPUs"):
        assert expected in reasons

    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    layouts = {(c.data.params["backend"], c.data.params["world_size"], c.data.params["tp"], c.data.params["dp"])
               for c in children}
    assert len(children) == 2 and layouts == EXPECTED_TRIALS
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    for child in children:
        assert child.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "train_loss")] == [1, 2]
        models = mlflow.search_logged_models(experiment_ids=[parent.info.experiment_id], output_format="list",
                                             filter_string=f"source_run_id = '{child.info.run_id}'")
        assert len(models) == 1  # the trial's final model, as a single run logs it
    # The injected failure hit one trial once; Tune restarted it and it continued its own child run.
    assert marker.exists()
    resumed = [c for c in children if c.data.tags.get("resumed_from_epoch")]
    assert len(resumed) == 1 and resumed[0].data.tags["resumed_from_epoch"] == "1"
    # One trial at a time: each child run starts and ends with its own trial, within the sweep, one after the other
    first, second = sorted(children, key=lambda c: c.info.start_time)
    assert parent.info.start_time < first.info.start_time < first.info.end_time <= second.info.start_time
    assert second.info.start_time < second.info.end_time <= parent.info.end_time

    check_report(client, download(mlflow_server, parent_id, "report", tmp_path), parent_id, children)
    check_ui_screenshots(mlflow_server, parent_id, children, tmp_path / "ui")
    # The best trial's model is registered, no other (trials register nothing themselves).
    [version] = client.search_model_versions(f"name = 'smoke-best-{tmp_path.name}'")
    assert version.run_id == parent.data.tags["best.run_id"]
    assert parent.data.tags["registered_model"] == f"smoke-best-{tmp_path.name}/{version.version}"
    # The console ends with the sweep's block: its best trial (the report's pick) and that trial's model.
    block = proc.stdout[proc.stdout.index("--- sweep ---"):proc.stdout.index(f"mlflow_parent_run_id={parent_id}")]
    assert f"best trial  {parent.data.tags['best.trial']}: test_accuracy " in block
    assert f"(run {version.run_id})" in block and f"/report  (rtp report {parent_id})" in block
    check_text_prediction(f"models:/smoke-best-{tmp_path.name}/{version.version}", tiny_imdb, mlflow_server,
                          ray_head, tmp_path)
    by_layout = {(c.data.params["backend"], c.data.params["world_size"]): c for c in children}
    check_text_run(client, by_layout[("ddp", "2")])


def mnist_sweep(args: list[str], scheduler: str, tmp_path: Path, data: Path, mlflow_server: str,
                ray_head: dict) -> tuple[MlflowClient, list]:
    """`python -m pipelines.sweep sweep=pbt_mnist <args>` on the tiny MNIST data, required to end like any sweep
    (exit 0, a FINISHED parent run of `scheduler` holding the report); returns (client, the child runs)."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.sweep", "sweep=pbt_mnist", f"data.path={data}",
                           f"run.storage_path={tmp_path / 'ray'}", *args],
                          cwd=ROOT, env=pipeline_env(mlflow_server, ray_head), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    parent = client.get_run(parent_id_from(proc.stdout))
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.scheduler"] == scheduler
    assert "report" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return client, children


def test_pbt_trial_continues_the_better_trials_checkpoint(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """Synchronous PBT over two MNIST MLP trials: at epoch 2 the trial whose learning rate (1e-6) cannot learn
    continues from the other's checkpoint with its recipe mutated. Its child run records the switch (tag, the
    mutated keys' values from epoch 3), its epochs from then on are as good as the checkpoint it took, the
    other trial is left alone, and the sweep ends like any other (statuses, nested runs, report)."""
    client, children = mnist_sweep(["trainer.epochs=3", "sweep.num_samples=1",
                                    "sweep.grid=[{trainer.lr:[0.000001,0.01]}]", "sweep.pbt_synch=true",
                                    "sweep.pbt_quantile=0.5", "sweep.pbt_interval=2"],
                                   "pbt", tmp_path, tiny_mnist, mlflow_server, ray_head)
    by_lr = {c.data.params["trainer.lr"]: c for c in children}
    assert set(by_lr) == {"1e-06", "0.01"} and all(c.info.status == "FINISHED" for c in children)
    poor, good = by_lr["1e-06"], by_lr["0.01"]

    assert poor.data.tags["pbt.exploited"] == f"trial{good.data.tags['sweep.trial_index']}@epoch2"
    assert "pbt.exploited" not in good.data.tags
    accuracy = epoch_values(client.get_metric_history(poor.info.run_id, "test_accuracy"))
    good_accuracy = epoch_values(client.get_metric_history(good.info.run_id, "test_accuracy"))
    assert len(accuracy) == 3 and accuracy[0] < 0.5  # on its own, lr 1e-6 learns nothing in an epoch
    assert accuracy[1] == good_accuracy[1] and accuracy[2] >= 0.9  # epoch 2: the state it took
    lrs = sorted(client.get_metric_history(poor.info.run_id, "hparam.trainer.lr"), key=lambda m: m.step)
    assert [m.step for m in lrs] == [1, 3] and lrs[0].value == 1e-6 and 1e-5 <= lrs[1].value <= 0.01
    batches = sorted(client.get_metric_history(poor.info.run_id, "hparam.trainer.batch_size"), key=lambda m: m.step)
    assert [m.step for m in batches] == [1, 3] and batches[1].value in (32, 64, 128)


def test_random_search_under_asha_stops_the_poor_trial_early(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """Random search: 2 learning rates drawn log-uniformly (`sweep.num_samples=2`, seed 0: 1.5e-4, 2.2e-6), one
    trial at a time under ASHA (a rung at epoch 1, keeping the top quarter). The first trial runs all 5 epochs;
    the one that cannot learn in an epoch is stopped there (a trial runs ahead of Tune's decision by an epoch or
    so, the other 3 epochs are the margin). Both child runs are FINISHED and nested under the parent, the stopped
    one tagged with its last epoch, and the parent holds the report."""
    client, children = mnist_sweep(["trainer.epochs=5", "sweep.scheduler=asha", "sweep.mutations=null",
                                    "sweep.num_samples=2", "sweep.grid=[{trainer.lr:{loguniform:[0.0000001,0.01]}}]",
                                    "sweep.max_concurrent_trials=1"],
                                   "asha", tmp_path, tiny_mnist, mlflow_server, ray_head)
    by_lr = {c.data.params["trainer.lr"]: c for c in children}
    assert set(by_lr) == {"0.000153", "2.233e-06"}  # the seeded draws, each a trial
    assert all(c.info.status == "FINISHED" for c in children)
    assert "sweep.stopped_early_after_epoch" not in by_lr["0.000153"].data.tags
    assert len(history(client, by_lr["0.000153"].info.run_id, "test_accuracy")) == 5
    stopped = by_lr["2.233e-06"]
    epochs = len(epoch_values(client.get_metric_history(stopped.info.run_id, "test_accuracy")))
    assert int(stopped.data.tags["sweep.stopped_early_after_epoch"]) < 5 and epochs < 5, epochs


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_kills_a_running_sweep_and_says_so(signum, tmp_path, tiny_mnist, mlflow_server, ray_head):
    """Ctrl-C, or SIGTERM (`ray job stop`, `scancel`), once a trial trains: the sweep exits 1 with one line saying
    it was interrupted, its parent run and the running trial's run are KILLED (tag `interrupted` on the parent), not
    FAILED as Tune's own handler left them after Ctrl-C, nor RUNNING as Ray's own SIGTERM handler left them."""
    args = ["sweep=pbt_mnist", f"data.path={tiny_mnist}", f"run.storage_path={tmp_path / 'ray'}", "trainer.epochs=30",
            "sweep.scheduler=fifo", "sweep.mutations=null", "sweep.num_samples=1", "sweep.grid=[{trainer.lr: [0.001]}]"]
    with interruptible("pipelines.sweep", args, pipeline_env(mlflow_server, ray_head)) as sweep:
        parent_id = next(line.split()[3] for line in sweep.stdout if line.startswith("MLflow parent run "))
        next(line for line in sweep.stdout if "epoch 1/30: train_loss" in line)
        sweep.send_signal(signum)
        out, err = sweep.communicate(timeout=180)
    assert sweep.returncode == 1, err[-3000:]
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1] == f"error: interrupted ({name}); the MLflow parent run is KILLED"
    assert out.strip().splitlines()[-1] == f"mlflow_parent_run_id={parent_id}"
    client = MlflowClient(mlflow_server)
    parent = client.get_run(parent_id)
    assert parent.info.status == "KILLED" and parent.data.tags["interrupted"] == name
    [child] = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert child.info.status == "KILLED"


def check_ui_screenshots(mlflow_server: str, parent_id: str, children: list, out: Path) -> None:
    """`pipelines.sweep.screenshots` opens the sweep in the MLflow UI in headless Chromium: the comparison page shows
    every trial and its layout params; the metric pages, every trial's train_loss and test_accuracy curves, then
    the curve of every metric of the contract (text runs) for every trial."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.sweep.screenshots", parent_id, "--out", str(out)], cwd=ROOT,
                          env=pipeline_env(mlflow_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    compare, curves = (out / "compare_runs.txt").read_text(), (out / "metric_curves.txt").read_text()
    every_metric = (out / "all_metrics.txt").read_text()
    for child in children:
        name = child.info.run_name
        assert name in compare and f"{name} (train_loss)" in curves and f"{name} (test_accuracy)" in curves
        for metric in (*EPOCH_METRICS, *TEXT_METRICS, *FIRST_EPOCH_METRICS):
            assert f"{name} ({metric})" in every_metric, (name, metric)
    for name in ("backend", "world_size", "tp", "dp", "trainer.lr", "trainer.batch_size"):
        assert re.search(rf"^{re.escape(name)} ", compare, re.MULTILINE), name  # a row of the params table
    assert "\nMetrics\n" in compare  # its table scrolls (only the rows in view are text): the curves show the rest
    for shot in ("compare_runs", "compare_runs_table", "metric_curves", "all_metrics"):
        data = (out / f"{shot}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000, shot


def check_text_prediction(model_uri: str, data: Path, mlflow_server: str, ray_head: dict, tmp_path: Path) -> None:
    """`pipelines.predict` on the folder of raw reviews the tiny IMDb data was prepared from: Ray Data tokenises
    them with the training data's tokenizer (logged with the run) and scores them; the probabilities are the
    registered model's own on the same token ids, and they tell positive from negative reviews."""
    import mlflow

    output = tmp_path / "predictions.parquet"
    proc = subprocess.run([sys.executable, "-m", "pipelines.predict", f"model={model_uri}",
                           f"input={data.parent / 'src'}", f"output={output}"], cwd=ROOT,
                          env=pipeline_env(mlflow_server, ray_head), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sources, texts = read_texts(data.parent / "src", clean=clean_text)  # as the IMDb preparation cleaned them
    tokenise = Tokenise((data / "tokenizer.json").read_text(), 48, read_manifest(data)["head_tokens"])
    ids = tokenise(pa.table({"text": texts})).column("input_ids")
    model = mlflow.pytorch.load_model(model_uri)  # MLflow 3 logs torch.export programs: already in eval mode
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(np.stack(ids.to_numpy(zero_copy_only=False))).long())
                                 .double(), dim=1)
    table = pq.read_table(output)
    assert table.column("source").to_pylist() == sources
    probabilities = torch.from_numpy(np.stack(table.column("probabilities").to_numpy(zero_copy_only=False)))
    torch.testing.assert_close(probabilities.double(), expected, rtol=1e-4, atol=1e-6)
    positive = np.array(["/pos/" in source for source in sources])
    assert np.mean(np.array(table.column("prediction").to_pylist()) == positive) >= 0.75


def check_text_run(client: MlflowClient, run) -> None:
    """A 2-worker DDP run of the tiny BERT: the text metrics every epoch, the validation split, and learning
    (sentiment words make the generated reviews learnable; chance is 0.5)."""
    assert run.data.params["model.name"] == "bert" and run.data.params["data.eval_split"] == "validation"
    for name in (*EPOCH_METRICS, *TEXT_METRICS):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [1, 2], name
    losses = history(client, run.info.run_id, "train_loss")
    assert losses[-1] < 0.75 * losses[0]
    assert history(client, run.info.run_id, "test_accuracy")[-1] >= 0.75


def download(uri: str, run_id: str, path: str, tmp_path) -> str:
    import mlflow.artifacts

    return mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=str(tmp_path / "dl"),
                                               tracking_uri=uri)


def check_report(client: MlflowClient, local: str, parent_id: str, children: list) -> None:
    """The report's numbers are those of the child runs' metrics."""
    with open(f"{local}/scaling_report.csv") as handle:
        rows = {r["run_id"]: r for r in csv.DictReader(handle)}
    assert set(rows) == {c.info.run_id for c in children}
    throughput = {}
    for child in children:
        run_id, row = child.info.run_id, rows[child.info.run_id]
        samples = history(client, run_id, "samples_per_s")
        throughput[run_id] = samples[1]  # 2 epochs: the steady value is epoch 2's
        assert float(row["samples_per_s"]) == pytest.approx(samples[1], rel=1e-9)
        assert float(row["test_accuracy"]) == pytest.approx(history(client, run_id, "test_accuracy")[-1])
        peak = max(history(client, run_id, "peak_memory_bytes"))
        assert float(row["peak_memory_mib"]) == pytest.approx(peak / 2**20) and peak > 50 * 2**20
    by_layout = {(rows[c.info.run_id]["backend"], rows[c.info.run_id]["workers"]): c.info.run_id for c in children}
    one, two = by_layout[("ddp", "1")], by_layout[("ddp", "2")]
    speedup = throughput[two] / throughput[one]
    assert float(rows[two]["speedup"]) == pytest.approx(speedup, rel=1e-9)
    assert float(rows[two]["efficiency"]) == pytest.approx(speedup / 2, rel=1e-9)
    assert float(rows[one]["speedup"]) == pytest.approx(1.0)
    best = max(children, key=lambda c: history(client, c.info.run_id, "test_accuracy")[-1])
    best_accuracy = history(client, best.info.run_id, "test_accuracy")[-1]
    parent = client.get_run(parent_id)
    assert parent.data.metrics["best.test_accuracy"] == pytest.approx(best_accuracy)
    markdown = open(f"{local}/scaling_report.md").read()
    assert sum(line.startswith("| ddp-") for line in markdown.splitlines()) == 2
    for name in ("throughput_vs_workers.png", "efficiency_vs_workers.png", "loss_curves.png"):
        data = open(f"{local}/{name}", "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name

