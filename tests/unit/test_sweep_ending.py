"""The end of a sweep whose tracking server is away when its trials end (pipelines/sweep/runs.py finish_sweep):
nothing is marked, how each trial ended is kept beside the trials' spooled records, a continued sweep refuses to
start before MLflow has heard it, and `pipelines.replay` of the parent's spool folder, with the server back, finishes
every run as the sweep would have. The sweep's runs are real ones in a real MLflow store; "away" is an address
nothing listens on."""
from __future__ import annotations

import mlflow
import pytest
from omegaconf import OmegaConf

from contract import resume, tracking
from pipelines.config import ConfigError
from pipelines.replay import main as replay_main
from pipelines.sweep.run import validate
from pipelines.sweep.runs import (Outcome, SweepEnding, SweepTrackingDown, child_run, child_specs, children_of,
                                  finish_sweep, note_trial_time, recorded_children, start_parent, trials_folder)
from pipelines.sweep.space import load_sweep, plan_trials
from tests.conftest import free_port

GRID = "sweep.grid=[{trainer: [ddp], trainer.num_workers: [1, 2]}]"


def test_a_sweep_ending_while_the_server_is_away_is_kept_and_replayed(tmp_path, tiny_mnist, monkeypatch, capsys):
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")):
        monkeypatch.setenv(name, value)  # what a worker's spool sets, undone after the test
    monkeypatch.chdir(tmp_path)  # the local store keeps its artifacts under the working directory
    store, away = f"sqlite:///{tmp_path}/mlflow.db", f"http://127.0.0.1:{free_port()}"
    storage, resume_dir = tmp_path / "ray", tmp_path / "resume"
    resume_dir.mkdir()
    overrides = [f"data.path={tiny_mnist}", f"run.storage_path={storage}", f"run.resume_dir={resume_dir}"]
    spec = load_sweep("mnist_backends", [GRID, "sweep.scheduler=fifo"])
    trials = plan_trials(spec, overrides)
    parent_id = start_parent(store, spec, trials, {"cpus": 2, "gpus": 0})
    # Trial 0 starts (its child run is created then; a restart by Tune finds it again) and ends; trial 1 never
    # starts: the sweep creates its run at the end.
    folder, configs = trials_folder(str(storage), parent_id), [OmegaConf.to_container(t.cfg) for t in trials]
    first_id = child_run(store, folder, 0, child_specs(parent_id, trials)[0], configs[0])
    assert child_run(store, folder, 0, child_specs(parent_id, trials)[0], configs[0]) == first_id
    note_trial_time(folder, 0)
    ended = recorded_children(folder)[0]["ended_ms"]
    children, ends = children_of(store, parent_id, trials, [0, 1], str(resume_dir))
    assert children[0] == first_id and ends == {0: ended}
    assert resume.recorded_sweep(str(resume_dir)) == (parent_id, children)
    # trial 0 trained 2 epochs that its rank 0 spooled, the server being away; trial 1 failed after one epoch
    logger = tracking.EpochLogger(tracking.TrackingSpool(away, children[0], tracking.spool_dir(str(storage),
                                                                                               children[0]), "rank0"))
    for epoch, loss in ((1, 0.9), (2, 0.6)):
        logger.log(epoch, {"train_loss": loss, "test_accuracy": 0.5 + epoch / 10, "epoch_time_s": 1.0,
                           "samples_per_s": 100.0})
    mlflow.MlflowClient(store).log_metric(children[1], "train_loss", 1.1, step=1)
    ending = SweepEnding(parent_id, away, OmegaConf.to_container(spec, resolve=True), children,
                         {0: Outcome("FINISHED"), 1: Outcome("FAILED", "RuntimeError: worker died")}, len(children),
                         False, None, str(storage), ends)

    with pytest.raises(SweepTrackingDown) as down:
        finish_sweep(ending)
    folder = tracking.spool_dir(str(storage), parent_id)
    assert str(down.value).endswith(f"once the server is back, finish the sweep with "
                                    f"`rtp replay {folder}`")
    client = mlflow.MlflowClient(store)
    assert {client.get_run(r).info.status for r in [parent_id, *children.values()]} == {"RUNNING"}
    with pytest.raises(ConfigError, match="run `rtp replay"):  # a rerun would lose the ending
        validate(["sweep=mnist_backends", GRID, *overrides])

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # back (here: the store the server serves)
    assert replay_main([str(folder)]) == 0
    assert f"mlflow_parent_run_id={parent_id}" in capsys.readouterr().out.splitlines()
    first, second, parent = (client.get_run(r) for r in (children[0], children[1], parent_id))
    assert first.info.status == "FINISHED" and first.info.end_time == ended  # when the trial ended, not the replay
    assert second.data.tags["mlflow.parentRunId"] == parent_id and second.info.end_time > ended
    assert sorted(m.step for m in client.get_metric_history(children[0], "train_loss")) == [1, 2]
    assert second.info.status == "FAILED" and second.data.tags["error"].startswith("RuntimeError: worker died")
    assert parent.info.status == "FAILED" and parent.data.metrics["trials_failed"] == 1
    assert "scaling_report.md" in {a.path.split("/")[-1] for a in client.list_artifacts(parent_id, "report")}
    assert not (folder / tracking.SWEEP_FILE).exists()
    assert tracking.spool_files(tracking.spool_dir(str(storage), children[0])) == []


def test_a_stop_the_server_does_not_hear_waits_in_the_spool_for_the_continued_run(tmp_path, monkeypatch):
    """`mark_preempted` with a spool folder: the server away, the stop point is kept (the run stays RUNNING),
    and the continued run's first flush records it."""
    monkeypatch.chdir(tmp_path)
    store, away = f"sqlite:///{tmp_path}/mlflow.db", f"http://127.0.0.1:{free_port()}"
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("stop")).info.run_id
    folder = tmp_path / "spool"
    assert tracking.mark_preempted(away, run_id, "epoch 1 step 10", folder) is False
    assert tracking.spooled(folder) == 1 and client.get_run(run_id).info.status == "RUNNING"
    assert tracking.flush_spools(store, run_id, folder) == 0
    assert tracking.mark_preempted(store, run_id, "epoch 2 step 20", folder) is True  # a second stop, heard
    run = client.get_run(run_id)
    assert run.data.tags["preempted_at"] == "epoch 1 step 10,epoch 2 step 20" and run.info.status == "KILLED"
