"""A resumed Lightning run trains with the optimizer hyperparameters its config gives, not those in the checkpoint.

Lightning restores a checkpoint's optimizer state whole, learning rates and weight decay included, after the
LightningModule's `configure_optimizers` has built the optimizer from its config. A changed config would then be
ignored: a user resuming with a lower learning rate, or a PBT trial continuing another trial's checkpoint with a
mutated one. Every other backend resumes with the config's hyperparameters and the checkpoint's state
(trainers/torch/recipe.py `TorchRecipe.load_state_dict`); `ConfiguredHyperparameters` does the same for any
LightningModule, a user's own included, whatever its optimizer and schedule:

- The learning rate stays where the restored schedule has taken it, scaled by the change of the configured rate
  (the schedule's `initial_lr`): a schedule that multiplies its base rate (LambdaLR, StepLR, cosine, warmup, ...)
  continues as if it had started from the new rate. Without a schedule the rate is the configured one.
- The schedule's anchors (`initial_lr`, `max_lr`, `min_lr`) and base rates, weight decay and the optimizer's
  other settings are the configured ones; momentum too, unless a schedule cycles it (OneCycleLR, CyclicLR).
- The optimizer's moments and the schedule's position stay the checkpoint's.

With an unchanged config nothing changes: a stopped run resumes on the curve it left.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

SCHEDULED = ("lr", "params")                  # the restored group keeps these (the rate is rescaled)
CYCLED = ("momentum", "betas")                # kept as restored when a schedule cycles them
CYCLE_MARK = "max_momentum"                   # in a param group whose momentum a schedule cycles

Groups = list[list[dict[str, Any]]]           # per optimizer, per param group: its settings


def configured_groups(optimizers: list[torch.optim.Optimizer]) -> Groups:
    """Each optimizer's param groups' settings, as `configure_optimizers` made them."""
    return [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]


def reapply(optimizers: list[torch.optim.Optimizer], schedulers: list[Any], configured: Groups) -> None:
    """After a checkpoint was loaded into `optimizers` and `schedulers`: the `configured` settings back, the rate
    rescaled along its restored schedule (module docstring)."""
    for optimizer, groups in zip(optimizers, configured):
        own = [s for s in schedulers if getattr(s, "optimizer", None) is optimizer]
        for index, (group, fresh) in enumerate(zip(optimizer.param_groups, groups)):
            group["lr"] = rescaled_lr(group, fresh, scheduled=bool(own))
            cycled = CYCLE_MARK in group
            group.update({k: v for k, v in fresh.items() if k not in SCHEDULED and not (cycled and k in CYCLED)})
            for scheduler in own:
                if hasattr(scheduler, "base_lrs") and "initial_lr" in fresh:
                    scheduler.base_lrs[index] = fresh["initial_lr"]


def rescaled_lr(group: dict[str, Any], fresh: dict[str, Any], scheduled: bool) -> float:
    """The rate to continue with: the restored one times the change of the schedule's configured start; the
    configured rate without a schedule; the restored one under a schedule that keeps no start (ReduceLROnPlateau),
    or from a start of 0 (nothing to scale: the configured schedule's first rate)."""
    if "initial_lr" in fresh and "initial_lr" in group:
        if group["initial_lr"] == 0:
            return fresh["lr"]
        return group["lr"] * (fresh["initial_lr"] / group["initial_lr"])  # exactly 1 for an unchanged start
    return group["lr"] if scheduled else fresh["lr"]


class ConfiguredHyperparameters(pl.Callback):
    """Takes the optimizers' settings once `configure_optimizers` has run (Lightning's `on_fit_start`, before it
    restores a checkpoint) and puts them back once the checkpoint is restored (`on_train_start`)."""

    def __init__(self) -> None:
        self.configured: Groups = []

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.configured = configured_groups(trainer.optimizers)

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            reapply(trainer.optimizers, [config.scheduler for config in trainer.lr_scheduler_configs],
                    self.configured)
