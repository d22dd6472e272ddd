"""Testing hooks (`fault.*`), injected through the loop's callbacks: a rank that fails once at an epoch's start or
at a step (raising, or killed), a rank that hangs once at a step. The integration tests and benchmarks/chaos.py
drive them."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from trainers.callbacks.base import LoopCallback


class FaultInjection(LoopCallback):
    """`fault.inject_at_epoch`, `fault.inject_at_step` and `fault.inject_hang_at_step` for rank `rank` of
    `world_size`."""

    def __init__(self, fault: Any, rank: int, world_size: int):
        self.fault, self.rank, self.world_size = fault, rank, world_size

    def on_epoch_start(self, epoch: int, done: int) -> None:
        maybe_inject_failure(self.fault, epoch, self.rank, self.world_size)

    def steps_to_boundary(self, step: int) -> int | None:
        """A call of several steps ends before a step a fault is injected at, so that it fires at that step."""
        ahead = [at - step for at in (self.fault.inject_at_step, self.fault.inject_hang_at_step)
                 if at is not None and at > step]
        return min(ahead, default=None)

    def on_step_start(self, epoch: int, step: int) -> None:
        if self.fault.inject_at_step == step:
            maybe_inject_failure_at_step(self.fault, step, self.rank, self.world_size)
        if self.fault.inject_hang_at_step is not None:
            maybe_inject_hang(self.fault, step, self.rank, self.world_size)


def maybe_inject_failure(fault: Any, epoch: int, rank: int, world_size: int) -> None:
    """Testing hook: fail once, in the last rank, at `fault.inject_at_epoch`. Every rank first waits for the
    others at Ray Train's barrier: a rank's `ray.train.report` of the last epoch returns when its own report is
    queued, and rank 0's (which uploads the checkpoint) may still be on its way. Were the failure seen first, Ray
    Train would restart from the checkpoint before, not from the last epoch's."""
    if fault.inject_at_epoch != epoch or not fault.inject_marker:
        return
    if world_size > 1:
        import ray.train.collective

        ray.train.collective.barrier()
    if rank != world_size - 1:
        return
    marker = Path(fault.inject_marker)
    if marker.exists():
        return
    marker.write_text(f"failed at epoch {epoch} in rank {rank}\n")
    raise RuntimeError(f"injected failure at epoch {epoch} (rank {rank})")


def maybe_inject_hang(fault: Any, step: int, rank: int, world_size: int) -> None:
    """Testing hook: once, the last rank enters a collective no other rank joins (Ray Train's barrier) before the
    run's global step `fault.inject_hang_at_step`; the others then wait in that step's collectives. Only the hang
    watcher ends it."""
    if fault.inject_hang_at_step != step or rank != world_size - 1:
        return
    marker = Path(fault.inject_marker)
    if marker.exists():
        return
    marker.write_text(f"hung at step {step} in rank {rank}\n")
    if world_size == 1:
        threading.Event().wait()
    import ray.train.collective

    ray.train.collective.barrier()


def maybe_inject_failure_at_step(fault: Any, step: int, rank: int, world_size: int) -> None:
    """Testing hook: fail once, in the last rank, before the run's global step `fault.inject_at_step` (raise, or
    with `fault.inject_kill` be killed). It first waits until Ray Train has registered every checkpoint reported
    before (uploaded in the background, inside the epoch), so the restart resumes from the latest whatever the
    speed of the uploads: Ray Train registers a checkpoint once it has collected every rank's report of it, and a
    rank killed first takes its report, and that checkpoint, with it."""
    marker = Path(fault.inject_marker)
    if rank != world_size - 1 or marker.exists():
        return
    import ray.train

    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    marker.write_text(f"failed at step {step} in rank {rank}\n")
    if fault.inject_kill:  # as a lost node or the OOM killer would: no exception, nothing cleaned up
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure at step {step} (rank {rank})")
