"""Scaling report maths and files, from hand-made trial histories."""
from __future__ import annotations

import csv

import pytest

from pipelines.sweep.report import (TrialRecord, add_scaling, best_row, build_report, steady, summarise,
                                      time_to_target)


def record(name: str, backend: str, workers: int, samples_per_s: list[float], accuracy: list[float],
           batch_size: int = 16, tp: int = 1) -> TrialRecord:
    epochs = len(samples_per_s)
    history = {"samples_per_s": samples_per_s, "test_accuracy": accuracy, "epoch_time_s": [2.0] * epochs,
               "train_loss": [1.0 / (e + 1) for e in range(epochs)],
               "peak_memory_bytes": [100 * 2**20 + e * 2**20 for e in range(epochs)]}
    return TrialRecord(f"id-{name}", name, backend, workers, tp, workers // tp, batch_size, 0.001, "FINISHED", history)


def test_steady_throughput_skips_the_first_epoch():
    assert steady([10.0, 100.0, 200.0]) == 150.0
    assert steady([10.0]) == 10.0
    assert steady(None) is None


def test_time_to_target_sums_epochs_until_the_first_hit():
    assert time_to_target([0.5, 0.7, 0.9], [1.0, 2.0, 4.0], 0.7) == 3.0
    assert time_to_target([0.5, 0.6], [1.0, 2.0], 0.7) is None


def test_speedup_and_efficiency_against_the_one_worker_trial_of_the_same_backend():
    trials = [record("d1", "ddp", 1, [1.0, 100.0], [0.5, 0.6]), record("d2", "ddp", 2, [1.0, 150.0], [0.5, 0.8]),
              record("d4", "ddp", 4, [1.0, 200.0], [0.5, 0.7]), record("t2", "tp", 2, [1.0, 90.0], [0.5, 0.9], tp=2),
              record("d2b", "ddp", 2, [1.0, 300.0], [0.5, 0.5], batch_size=64)]
    rows = [summarise(t, target_accuracy=0.75) for t in trials]
    add_scaling(rows)
    by_name = {r["trial"]: r for r in rows}
    assert by_name["d1"]["speedup"] == 1.0 and by_name["d1"]["efficiency"] == 1.0
    assert by_name["d2"]["speedup"] == pytest.approx(1.5) and by_name["d2"]["efficiency"] == pytest.approx(0.75)
    assert by_name["d4"]["efficiency"] == pytest.approx(0.5)
    assert by_name["d4"]["samples_per_s_per_worker"] == pytest.approx(50.0)
    assert best_row(rows, "samples_per_s_per_worker", "max")["trial"] == "d2b"  # 150 per worker
    assert by_name["t2"]["speedup"] is None          # no 1-worker tp trial
    assert by_name["d2b"]["speedup"] is None         # no 1-worker ddp trial with batch size 64
    assert by_name["d2"]["time_to_target_s"] == 4.0 and by_name["d1"]["time_to_target_s"] is None
    assert by_name["d2"]["peak_memory_mib"] == 101.0
    assert by_name["d2"]["test_accuracy"] == 0.8 and by_name["d2"]["train_loss"] == 0.5


def test_flop_columns_only_where_trials_logged_them():
    """A CPU sweep's trials log `tflops_per_rank` and no `mfu` (no peak to divide by): the report shows the
    first, its mean after the first epoch, and leaves the other out."""
    from pipelines.sweep.report import shown_columns

    trials = [record("d1", "ddp", 1, [1.0, 100.0], [0.5, 0.6]), record("d2", "ddp", 2, [1.0, 150.0], [0.5, 0.8])]
    trials[1].history["tflops_per_rank"] = [0.1, 0.3, 0.5]
    rows = [summarise(t, target_accuracy=0.75) for t in trials]
    assert rows[1]["tflops_per_rank"] == pytest.approx(0.4) and rows[0]["tflops_per_rank"] is None
    columns = shown_columns(rows)
    assert "tflops_per_rank" in columns and "mfu" not in columns
    trials[0].history["mfu"] = [0.2, 0.4]
    assert "mfu" in shown_columns([summarise(t, target_accuracy=0.75) for t in trials])


def test_best_row_by_metric_and_mode_skips_missing_values():
    rows = [{"trial": "a", "speedup": None, "train_loss": 0.3}, {"trial": "b", "speedup": 1.5, "train_loss": 0.2},
            {"trial": "c", "speedup": 1.2, "train_loss": float("nan")}]
    assert best_row(rows, "speedup", "max")["trial"] == "b"
    assert best_row(rows, "train_loss", "min")["trial"] == "b"
    assert best_row([{"trial": "a", "speedup": None}], "speedup", "max") is None


def test_build_report_writes_consistent_csv_markdown_and_plots(tmp_path):
    trials = [record("d1", "ddp", 1, [1.0, 100.0], [0.5, 0.6]), record("d2", "ddp", 2, [1.0, 150.0], [0.5, 0.8])]
    report = build_report(trials, tmp_path, target=0.75, metric="test_accuracy", mode="max")
    assert report.best["trial"] == "d2"
    with open(report.files["csv"]) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["trial"] for r in rows] == ["d1", "d2"]
    assert float(rows[1]["speedup"]) == pytest.approx(1.5) and rows[0]["time_to_target_s"] == ""
    table = [line for line in report.markdown.splitlines() if line.startswith("| d")]
    assert len(table) == 2 and "**d2**" in report.markdown
    assert report.files["markdown"].read_text() == report.markdown
    for key in ("throughput", "efficiency", "losses"):
        data = report.files[key].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, key


def test_rtp_report_of_a_run_that_is_not_a_sweep_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from contract import tracking
    from pipelines.sweep.report import main

    monkeypatch.chdir(tmp_path)  # the local store keeps its artifacts under the working directory
    store = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    lone = tracking.start_run(store, "reports", "not-a-sweep", {}, "")
    assert main(["0123456789abcdef0123456789abcdef"]) == 2
    assert main([lone]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: parent_run_id: {store} holds no MLflow run 0123456789abcdef0123456789abcdef (a "
                      f"sweep's run id: its `mlflow_parent_run_id=` line)",
                      f"error: parent_run_id: MLflow run {lone} has no trial runs under it: not a sweep's run"]
