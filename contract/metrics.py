"""The one metric set every backend logs, and how it is computed from the ranks' epoch totals.

Rank 0 logs, per epoch (MLflow step = epoch): EPOCH_METRICS always, with the task's evaluation metric in place
of `test_accuracy` (EVAL_METRICS: `test_mse` for regression), TEXT_METRICS for token data, and
FIRST_EPOCH_METRICS at the first epoch of every attempt (a resumed run logs them again). `step_loss` every
`trainer.log_every_n_steps` global steps: the mean loss of that step's global batch (over every data-parallel
rank; Keras `fit`: of the steps since the last one logged). Tags: `rank<r>.node` per worker, `resumed_from_epoch`,
and on a stop `preempted_at` (contract/tracking/runs.py).
"""
from __future__ import annotations

import resource
from typing import Callable

from contract.checkpoint import EpochTotals

EPOCH_METRICS = ("train_loss", "test_accuracy", "samples_per_s", "step_time_ms", "data_wait_fraction",
                 "epoch_time_s", "peak_memory_bytes")
TEXT_METRICS = ("tokens_per_s",)
# task -> the metric each epoch's evaluation logs (on the dataset's evaluation split): accuracy, or mean squared error
EVAL_METRICS = {"classification": "test_accuracy", "regression": "test_mse"}
ALL_EPOCH_METRICS = (*EPOCH_METRICS, *(m for m in EVAL_METRICS.values() if m not in EPOCH_METRICS), *TEXT_METRICS)
FIRST_EPOCH_METRICS = ("data_load_s",)
EPOCH_END = "epoch_end_s"  # per epoch (rank 0): its evaluation, metrics and checkpoint, for the run's goodput
# per epoch with checkpoints inside it (rank 0): the seconds they held training up, and how many they were
STEP_CHECKPOINTS_S, STEP_CHECKPOINTS = "step_checkpoints_s", "step_checkpoints"
# once, by the driver: exporting, logging and registering the final model; scoring it on the held-out test split
FINAL_MODEL_LOG, FINAL_MODEL_TEST = "final_model.log_s", "final_model.test_s"
STEP_METRIC = "step_loss"
STOP_METRICS = ("stopped_at_epoch", "stopped_at_step")  # what the driver sees in a stopped run's result
STEP_CHECKPOINT_METRICS = ("checkpoint_at_epoch", "checkpoint_at_step")  # a checkpoint's report inside an epoch
# a run whose loss stopped being a number: the epoch and the global step (0: the epoch's mean), in the last report
# (Tune sees it) and in this file of the run's folder, which the driver reads (Ray Train's result carries the
# metrics of checkpoints only, and a diverged state is never checkpointed)
DIVERGED_METRICS = ("diverged_at_epoch", "diverged_at_step")
DIVERGED_FILE = "diverged.json"
REPORTED_EPOCH = "epoch"  # beside an epoch's metrics in its report to Ray Train (and Tune): the epoch's number
REPORTED_BEST_EPOCH = "best_epoch"  # ...and the best epoch so far by `run.monitor` (this one: keep its checkpoint)

# (values, "sum" | "max") -> each value reduced over all ranks. Every backend supplies one over its own
# collectives (torch.distributed, Horovod, a TF strategy); the loop uses it for metrics and the stop agreement.
Reducer = Callable[[list[float], str], list[float]]
# A reduction started earlier (`Adapter.reduce_later`): calling it waits for the result (collective until then).
PendingReduce = Callable[[], list[float]]
# (values, op) -> that reduction, started now: asynchronous where the backend's collectives can be.
AsyncReducer = Callable[[list[float], str], PendingReduce]


def reduce_at_once(reduce: Reducer, values: list[float], op: str) -> PendingReduce:
    """`reduce_later` of a backend without asynchronous collectives: reduces now, hands the result over later."""
    result = reduce(values, op)
    return lambda: result


def eval_metric(task: str) -> str:
    return EVAL_METRICS[task]


def metric_names(task: str = "classification", text: bool = False) -> tuple[str, ...]:
    """The per-epoch metrics a run of `task` logs at every epoch (`text`: token data)."""
    return (tuple(eval_metric(task) if name == "test_accuracy" else name for name in EPOCH_METRICS)
            + (TEXT_METRICS if text else ()))


def epoch_metrics(totals: EpochTotals, score: float, total: int, reduce: Reducer, peak_bytes: float,
                  ranks_per_sample: int = 1, evaluated: str = "test_accuracy") -> dict[str, float]:
    """The metrics of one epoch over all ranks (sums, and the slowest rank's time). `evaluated` (the task's
    `eval_metric`) is the mean of `score` over the `total` rows of the dataset's evaluation split: correct
    predictions, or squared errors. `ranks_per_sample`: ranks that process each sample (a tensor- or
    pipeline-parallel group), so throughput counts every sample once. A collective: every rank calls it."""
    loss_sum, samples, steps, wait_s, train_s, tokens, score_all, total_all = reduce(
        [totals.loss_sum, totals.samples, totals.steps, totals.data_wait_s, totals.train_s, totals.tokens,
         score, total], "sum")
    slowest_s, peak = reduce([totals.train_s, peak_bytes], "max")
    metrics = {
        "train_loss": loss_sum / max(samples, 1),
        evaluated: score_all / max(total_all, 1),
        "samples_per_s": samples / ranks_per_sample / max(slowest_s, 1e-9),
        "step_time_ms": 1000.0 * train_s / max(steps, 1),
        "data_wait_fraction": wait_s / max(train_s, 1e-9),
        "epoch_time_s": slowest_s,
        "peak_memory_bytes": peak,  # the largest rank's peak so far (sweep scaling reports)
    }
    if tokens:
        metrics["tokens_per_s"] = tokens / ranks_per_sample / max(slowest_s, 1e-9)
    return {name: float(value) for name, value in metrics.items()}


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float]) -> str:
    """Rank 0's progress line for an epoch, printed at its end (in the driver's output through Ray's log)."""
    evaluated = next(name for name in EVAL_METRICS.values() if name in metrics)
    return (f"epoch {epoch}/{epochs}: train_loss {metrics['train_loss']:.4f}, "
            f"{evaluated} {metrics[evaluated]:.4f}, {metrics['samples_per_s']:,.0f} samples/s, "
            f"{metrics['epoch_time_s']:.1f} s")


def peak_rss_bytes() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def stop_metrics(epoch: int, steps: int) -> dict[str, float]:
    return dict(zip(STOP_METRICS, (float(epoch), float(steps))))


def step_checkpoint_metrics(epoch: int, steps: int) -> dict[str, float]:
    return dict(zip(STEP_CHECKPOINT_METRICS, (float(epoch), float(steps))))
