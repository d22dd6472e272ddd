"""pipelines/goodput.py: the parts of a run's wall time, from the metrics its driver and rank 0 logged."""
from __future__ import annotations

import pytest

from pipelines.goodput import goodput, startup_in_run

WORKER_PARTS = {"startup.workers_s": 7.0, "startup.data_s": 2.0, "startup.model_s": 1.5}


def test_startup_counts_the_drivers_part_after_the_runs_creation():
    logged = {**WORKER_PARTS, "startup.driver_s": 16.0, "startup.driver_before_run_s": 4.0}
    assert startup_in_run(logged) == pytest.approx(12.0 + 10.5)


def test_a_run_without_the_drivers_split_counts_its_workers_parts_only():
    assert startup_in_run({**WORKER_PARTS, "startup.driver_s": 16.0}) == pytest.approx(10.5)
    assert startup_in_run({}) == 0.0  # no start-up logged (e.g. the first attempt never reached a step)


def test_the_parts_add_up_to_the_wall_time_checkpoints_inside_epochs_out_of_the_training():
    figures = goodput(wall_s=100.0, training_s=40.0, epoch_end_s=5.0, startup_s=30.0, final_s=15.0, checkpoint_s=4.0)
    parts = ("training", "checkpoint", "epoch_end", "startup", "final", "other")
    assert sum(figures[f"goodput.{part}_s"] for part in parts) == pytest.approx(100.0)
    assert figures["goodput.training_s"] == pytest.approx(36.0) and figures["goodput.checkpoint_s"] == 4.0
    assert figures["goodput.other_s"] == pytest.approx(10.0) and figures["goodput"] == pytest.approx(0.36)
