"""What a command finds of the runs before it (contract/tracking/runs.py), in a real MLflow store: a run whose
driver was killed with SIGKILL is closed FAILED by the next command on its host, never left RUNNING (unless its ending
waits in its spool for `rtp replay`); a run continued with another layout keeps its first params and tags what this
attempt changed; a run that fails as it is created ends FAILED; a second interrupt does not stop a run's ending."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from contract import resume, tracking
from tests.conftest import ROOT

DRIVER = """
import sys, time
from contract.tracking import start_run
print(start_run(sys.argv[1], "housekeeping", "killed", {"run.storage_path": sys.argv[2]}, ""), flush=True)
time.sleep(600)
"""


def test_a_run_whose_driver_was_killed_is_closed_failed_by_the_next_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the local store keeps its artifacts under the working directory
    store = f"sqlite:///{tmp_path}/mlflow.db"
    drivers, run_ids = [], []
    for _ in range(2):  # one after the other: a new sqlite store takes its first writers one at a time
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, store, str(tmp_path / "ray")], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        run_ids.append(driver.stdout.readline().strip())  # the run exists, RUNNING, when this line comes
        drivers.append(driver)
    for driver in drivers:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    killed, awaiting = run_ids
    # the second one's ending waits in its spool (its server was away when it ended): `rtp replay` closes it
    folder = tracking.spool_dir(str(tmp_path / "ray"), awaiting)
    folder.mkdir(parents=True)
    (folder / tracking.FINAL_FILE).write_text("{}")
    alive = tracking.start_run(store, "housekeeping", "alive", {}, "")  # this process drives it
    client = tracking.mlflow_client(store)
    assert client.get_run(killed).info.status == "RUNNING"

    assert tracking.close_orphaned_runs(store, "housekeeping") == [killed]
    run = client.get_run(killed)
    assert run.info.status == "FAILED" and str(drivers[0].pid) in run.data.tags["driver_lost"]
    assert client.get_run(alive).info.status == "RUNNING"  # its driver lives
    assert client.get_run(awaiting).info.status == "RUNNING"
    assert tracking.close_orphaned_runs(store, "housekeeping") == []
    assert tracking.close_orphaned_runs(store, "no-such-experiment") == []


def test_a_continued_run_with_another_layout_tags_what_this_attempt_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = tracking.start_run(store, "housekeeping", "requeued",
                                {"trainer.num_workers": 4, "world_size": 4, "trainer.lr": 0.001}, "")
    tracking.mark_preempted(store, run_id, "epoch 1 step 10")
    assert tracking.reopen_run(store, run_id) == "KILLED"
    changed = tracking.log_attempt_changes(store, run_id, {"trainer.num_workers": 2, "world_size": 2,
                                                           "trainer.lr": 0.001, "run.verbose": True})
    assert changed == {"attempt2.trainer.num_workers": "2", "attempt2.world_size": "2"}
    run = tracking.mlflow_client(store).get_run(run_id)
    assert run.data.params["world_size"] == "4" and run.data.tags["attempt2.world_size"] == "2"
    assert "attempt2.trainer.lr" not in run.data.tags


def test_a_run_whose_artifacts_cannot_be_stored_ends_failed_not_running(tmp_path, monkeypatch):
    """Creating a run logs its config as an artifact: where the artifact store refuses it, the run that was just
    created ends FAILED with the error (not RUNNING, unrecorded), though its error file cannot be stored either."""
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    client = tracking.mlflow_client(store)
    experiment = client.create_experiment("unstorable", artifact_location="file:///proc/rtp-no-such-folder")
    with pytest.raises(OSError):
        tracking.start_run(store, "unstorable", "refused", {"trainer.lr": 0.1}, "trainer:\n  lr: 0.1\n")
    (run,) = client.search_runs([experiment])
    assert run.info.status == "FAILED", run.info.status
    assert run.data.tags["error"].startswith("FileNotFoundError") and "rtp-no-such-folder" in run.data.tags["error"]
    assert run.data.tags["error.txt"].startswith("not stored: FileNotFoundError")


def test_signals_are_ignored_while_a_run_is_ended_and_taken_again_after():
    """`interrupts_ignored`, around ending a run after an interrupt: a second SIGTERM or Ctrl-C inside it changes
    nothing; after it, SIGTERM raises `Interrupted` again (`raise_on_sigterm`)."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        resume.raise_on_sigterm()
        with resume.interrupts_ignored():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            ended = True
        assert ended
        assert signal.getsignal(signal.SIGINT) is handlers[signal.SIGINT]
        with pytest.raises(resume.Interrupted, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_an_interrupt_raised_inside_a_c_call_is_still_an_interrupt():
    """SIGTERM's handler raising inside Ray's `wait` (a C call) comes out as a SystemError caused by `Interrupted`:
    still an interrupt (the run ends KILLED), and a SystemError of its own is a failure."""
    try:
        try:
            raise resume.Interrupted("SIGTERM")
        except resume.Interrupted as cause:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from cause
    except SystemError as wrapped:
        assert resume.interruption(wrapped) == "SIGTERM"
    assert resume.interruption(SystemError("a real one")) is None


def test_a_failed_runs_error_tag_is_the_errors_last_line_and_error_txt_the_whole(tmp_path, monkeypatch):
    """A worker's failure reaches the driver as Ray Train's error wrapping the worker's traceback: the run's `error`
    tag keeps the line that says what went wrong, the last; `error.txt` all of it."""
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = tracking.start_run(store, "errors", "failing", {"trainer.lr": 0.1}, "trainer:\n  lr: 0.1\n")
    error = ("TrainingFailedError: Training failed due to worker errors:\n[Rank 0]\nTraceback (most recent call "
             "last):\n  File \"process_group.py\", line 9, in join_group\n    dist.init_process_group(...)\n"
             "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
             "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE\n\n")
    tracking.end_run(store, run_id, error=error)
    client = tracking.mlflow_client(store)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == ("torch.distributed.DistNetworkError: The server socket has failed to listen on "
                                      "any local network address. port: 29500, useIpv6: false, code: -98, name: "
                                      "EADDRINUSE")
    assert client.download_artifacts(run_id, "error.txt", str(tmp_path)) and \
        (tmp_path / "error.txt").read_text() == error
