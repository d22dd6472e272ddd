"""A finished run's goodput: the share of its wall time that went into training steps, and where the rest went.

Logged by `rtp train` at the run's end (metrics, step 0):
- `goodput.wall_s`: from the MLflow run's creation to its end, over every attempt, restart and requeue;
- `goodput.training_s`: the training passes of its epochs, each epoch once (`epoch_time_s`: the slowest rank's),
  less the checkpoints inside them;
- `goodput.checkpoint_s`: the time checkpoints inside epochs held training up (`step_checkpoints_s`, rank 0's);
- `goodput.epoch_end_s`: the epochs' ends, each once (`epoch_end_s`: evaluation, metrics, checkpoint);
- `goodput.startup_s`: the first attempt's start-up after the run's creation: the driver's reading of the data
  and building of the trainer, then the start of its workers, data and model (contract/startup.py);
- `goodput.final_s`: the final model: exporting, logging and registering it, and scoring it on the held-out test
  split (`final_model.log_s`, `final_model.test_s`);
- `goodput.other_s`: the rest: restarts (new workers, the epoch trained again), the waits between a stop and its
  continuation, a requeued job's start;
- `goodput`: `goodput.training_s` over `goodput.wall_s`.
The six parts add up to the wall time.
"""
from __future__ import annotations

import time

from contract import tracking
from contract.metrics import EPOCH_END, FINAL_MODEL_LOG, FINAL_MODEL_TEST, STEP_CHECKPOINTS_S
from contract.startup import DRIVER_BEFORE_RUN

WORKER_STARTUP_PARTS = ("startup.workers_s", "startup.data_s", "startup.model_s")


def goodput(wall_s: float, training_s: float, epoch_end_s: float, startup_s: float, final_s: float,
            checkpoint_s: float = 0.0) -> dict[str, float]:
    """The parts of `wall_s`; `training_s` still holds `checkpoint_s` (checkpoints inside epochs)."""
    training_s -= checkpoint_s
    other_s = wall_s - training_s - checkpoint_s - epoch_end_s - startup_s - final_s
    return {"goodput": training_s / wall_s if wall_s > 0 else 0.0, "goodput.wall_s": wall_s,
            "goodput.training_s": training_s, "goodput.checkpoint_s": checkpoint_s, "goodput.epoch_end_s": epoch_end_s,
            "goodput.startup_s": startup_s, "goodput.final_s": final_s, "goodput.other_s": other_s}


def startup_in_run(metrics: dict[str, float]) -> float:
    """The first attempt's start-up after the run's creation, from its `startup.*` metrics: the driver's part
    less what came before the run (a run without `startup.driver_before_run_s` counts its workers' parts only)."""
    workers = sum(metrics.get(part, 0.0) for part in WORKER_STARTUP_PARTS)
    if DRIVER_BEFORE_RUN not in metrics:
        return workers
    return max(0.0, metrics.get("startup.driver_s", 0.0) - metrics[DRIVER_BEFORE_RUN]) + workers


def log_goodput(uri: str, run_id: str) -> dict[str, float]:
    """Read the run's epochs, start-up and final model's times from MLflow, log its goodput and breakdown; returns
    them."""
    client = tracking.mlflow_client(uri)
    run = client.get_run(run_id)

    def total(metric: str) -> float:
        return sum(tracking.epoch_values(client.get_metric_history(run_id, metric)))

    once = run.data.metrics  # the metrics logged once: the start-up's and the final model's
    figures = goodput(time.time() - run.info.start_time / 1000, total("epoch_time_s"), total(EPOCH_END),
                      startup_in_run(once), once.get(FINAL_MODEL_LOG, 0.0) + once.get(FINAL_MODEL_TEST, 0.0),
                      total(STEP_CHECKPOINTS_S))
    tracking.log_metrics(uri, run_id, figures)
    return figures
