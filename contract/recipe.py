"""The training recipe every backend applies the same way, framework-free: optimizer names, the learning-rate
schedule, precision names, and which epoch is best (`run.monitor`, early stopping with `run.patience`).

Backends turn these into their framework's objects (trainers/torch/recipe.py, trainers/tf/adapter.py); the numbers
come from here, so a cosine schedule with warmup is the same curve under PyTorch and TensorFlow.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")
MONITOR_MODES = ("max", "min")
FINAL_MODELS = ("best", "last")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of `trainer.lr` for optimizer step `step` (0-based: the update about to be applied).

    Warmup rises linearly to 1 over `warmup_steps` updates (the first update already uses 1/warmup_steps, never
    0); then `constant` stays at 1, `cosine` falls along half a cosine and `linear` along a line, reaching 0 after
    `total_steps` updates (clamped there if a run takes more)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown lr schedule '{schedule}' (choices: {LR_SCHEDULES})")


def updates_per_epoch(steps_per_epoch: int, grad_accum: int) -> int:
    """Optimizer steps in an epoch of `steps_per_epoch` batches: one per `grad_accum` batches, and one more for
    the batches left at the epoch's end (the loop's `finish_epoch` applies them)."""
    return -(-steps_per_epoch // grad_accum)  # ceil


def schedule_steps(trainer: Any, steps_per_epoch: int) -> tuple[int, int]:
    """(warmup, total) optimizer steps of a run's schedule: `trainer.epochs` epochs of `steps_per_epoch` batches;
    warmup is `trainer.warmup_steps`, or `trainer.warmup_fraction` of the total (rounded)."""
    total = trainer.epochs * updates_per_epoch(steps_per_epoch, trainer.grad_accum)
    return trainer.warmup_steps or round(trainer.warmup_fraction * total), total


def no_weight_decay(name: str, ndim: int) -> bool:
    """Biases and normalisation scales/offsets (the 0- and 1-d parameters) are not decayed: decaying them pulls
    activations' scale toward 0 for no regularising gain (the usual AdamW recipe, as in BERT and GPT)."""
    return ndim <= 1


@dataclass(frozen=True)
class Monitor:
    """Which epoch is best: `metric` (one of the epoch metrics) compared by `mode`; `patience`: stop after that
    many epochs without a better value (None: never stop early)."""
    metric: str = "test_accuracy"
    mode: str = "max"
    patience: int | None = None

    def better(self, value: float, best: float | None) -> bool:
        """Whether `value` takes over as the best. A tie goes to the later epoch, as Ray Train ranks equal scores,
        so the best epoch's checkpoint is always one Ray Train keeps."""
        if best is None:
            return True
        return value >= best if self.mode == "max" else value <= best

    def worst(self) -> float:
        """A value every real one beats (what a checkpoint of a half-done epoch is scored with). Finite: Ray
        Train's checkpoint snapshot is JSON, and an infinity comes back from it as None, failing the resume."""
        return -sys.float_info.max if self.mode == "max" else sys.float_info.max

    def exhausted(self, epoch: int, best_epoch: int) -> bool:
        """Early stopping: `patience` epochs have passed since the best one."""
        return self.patience is not None and epoch - best_epoch >= self.patience


def default_mode(metric: str) -> str:
    """`run.monitor_mode` when not given: lower is better for losses, errors and times, higher for the rest."""
    return "min" if metric.endswith(("loss", "mse", "_s", "_ms", "fraction", "bytes")) else "max"
