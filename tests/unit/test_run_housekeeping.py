"""What a command finds of the runs before it (contract/tracking/runs.py), in a real MLflow store: a run whose
driver was killed with SIGKILL is closed FAILED by the next command on its host, never left RUNNING (unless its ending
waits in its spool for `rtp replay`); a run continued
with another layout keeps its first params and tags what this attempt changed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from contract import tracking
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
