"""A finished run's goodput: the share of its wall time that went into training steps, and where the rest went.

Logged by `rtp train` at the run's end (metrics, step 0):
- `goodput.wall_s`: from the MLflow run's creation to its end, over every attempt, restart and requeue;
- `goodput.training_s`: the training passes of its epochs, each epoch once (`epoch_time_s`: the slowest rank's);
- `goodput.epoch_end_s`: the epochs' ends, each once (`epoch_end_s`: evaluation, metrics, checkpoint);
- `goodput.startup_s`: the first attempt's start of its workers, data and model (`startup.workers_s`, `.data_s`,
  `.model_s`; contract/startup.py);
- `goodput.other_s`: the rest: the driver before its workers, restarts (new workers, the epoch trained again),
  the waits between a stop and its continuation, the final model's logging;
- `goodput`: `goodput.training_s` over `goodput.wall_s`.
The four parts add up to the wall time.
"""
from __future__ import annotations

import time

from contract import tracking
from contract.metrics import EPOCH_END

STARTUP_PARTS = ("startup.workers_s", "startup.data_s", "startup.model_s")


def goodput(wall_s: float, training_s: float, epoch_end_s: float, startup_s: float) -> dict[str, float]:
    return {"goodput": training_s / wall_s if wall_s > 0 else 0.0, "goodput.wall_s": wall_s,
            "goodput.training_s": training_s, "goodput.epoch_end_s": epoch_end_s, "goodput.startup_s": startup_s,
            "goodput.other_s": wall_s - training_s - epoch_end_s - startup_s}


def log_goodput(uri: str, run_id: str) -> dict[str, float]:
    """Read the run's epochs and start-up from MLflow, log its goodput and breakdown; returns them."""
    client = tracking.mlflow_client(uri)
    run = client.get_run(run_id)

    def total(metric: str) -> float:
        return sum(tracking.epoch_values(client.get_metric_history(run_id, metric)))

    figures = goodput(time.time() - run.info.start_time / 1000, total("epoch_time_s"), total(EPOCH_END),
                      sum(total(part) for part in STARTUP_PARTS))
    tracking.log_metrics(uri, run_id, figures)
    return figures
