"""The best epoch's checkpoint, kept beside the last `run.keep_checkpoints` that Ray Train keeps.

Ray Train's own retention keeps either the last K checkpoints or the K best by one score fixed when each is
reported (and always the latest); "the last K, plus the best" is neither: whether a checkpoint is among the last K
changes with every later report, whether it is the best with every later epoch. So Ray Train keeps the last K,
and each epoch's checkpoint that is the best so far by `run.monitor` is linked into `best_checkpoint/` in the run's
storage folder (hard links: no copy of the weights, and the files outlive Ray Train deleting its folder).
`pipelines/fit.py: final_checkpoint` logs the model from there under `run.final_model=best`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ray.train import UserCallback

from contract.checkpoint import BEST_CHECKPOINT
from contract.metrics import REPORTED_BEST_EPOCH, REPORTED_EPOCH


class KeepBest(UserCallback):
    """In the Ray Train controller: after each report, the epoch's checkpoint kept as the best when it is."""

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if checkpoint is None or not metrics or REPORTED_EPOCH not in metrics[0]:
            return  # no checkpoint, or one inside an epoch (a step's, a stop's)
        if metrics[0].get(REPORTED_BEST_EPOCH) == metrics[0][REPORTED_EPOCH]:
            keep_as_best(Path(checkpoint.path))


def keep_as_best(checkpoint: Path) -> Path:
    """Replace the run's best checkpoint (beside `checkpoint`, in its storage folder) with `checkpoint`. The new
    one is complete before the old one goes: a crash in between leaves one of them in place."""
    best = checkpoint.parent / BEST_CHECKPOINT
    fresh, old = best.with_name(BEST_CHECKPOINT + ".new"), best.with_name(BEST_CHECKPOINT + ".old")
    shutil.rmtree(fresh, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(checkpoint, fresh, copy_function=link_or_copy)
    if best.exists():
        best.rename(old)
    fresh.rename(best)
    shutil.rmtree(old, ignore_errors=True)
    return best


def link_or_copy(source: str, target: str) -> None:
    """A hard link where the filesystem allows one, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
