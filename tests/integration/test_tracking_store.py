"""The local sqlite tracking store (the default MLFLOW_TRACKING_URI): several first runs at once on a new store all
finish, and a store an interrupted creation left half-made is one line saying how to recover, touching nothing."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, pipeline_env, run_id_from, run_pipeline

pytestmark = pytest.mark.slow


def test_first_runs_started_together_on_a_new_sqlite_store_all_finish(tmp_path, tiny_mnist, ray_head):
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    env = pipeline_env(f"sqlite:///{db}", ray_head)
    args = [f"data.path={tiny_mnist}", "trainer.epochs=1", "trainer.num_workers=1", "trainer.batch_size=64",
            "model.hidden=[16]", "run.system_metrics=false"]
    runs = [subprocess.Popen([sys.executable, "-m", "pipelines.train", *args, f"run.storage_path={tmp_path / str(i)}"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(3)]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
    client = MlflowClient(f"sqlite:///{db}")
    assert {client.get_run(run_id_from(out)).info.status for out, _ in outputs} == {"FINISHED"}
    assert client.get_experiment(client.create_experiment("after")).name == "after"  # the store takes writes


def half_created_store(db: Path) -> None:
    """A store as an interrupted creation leaves it: MLflow's schema migrated up to the revision before the last,
    with the temporary copy of a table that alembic's batch migration was rebuilding still in it."""
    client = MlflowClient(f"sqlite:///{db}")
    client.search_experiments()  # creates it, migrated to the newest revision
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0000_interrupted'")
        conn.execute("CREATE TABLE _alembic_tmp_experiments (experiment_id INTEGER)")


def test_a_half_created_store_is_one_line_saying_how_to_recover_and_stays_untouched(tmp_path, tiny_mnist):
    db = tmp_path / "mlflow.db"
    half_created_store(db)
    before = db.read_bytes()
    proc = run_pipeline([f"data.path={tiny_mnist}"], pipeline_env(f"sqlite:///{db}"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: the MLflow store {db} was left half-created (by runs that created it at "
                                   f"the same time) and holds no runs: move it aside (mv {db} {db}.broken) and run "
                                   f"again to create a new one")
    assert db.read_bytes() == before
