"""Stragglers: a rank whose own work keeps the others waiting.

In synchronous training every rank's step takes the same time: the fast ranks wait inside the step's collectives
for the slow one. What differs is the time a rank spends on its own before it joins them: waiting for its next
batch (`data_wait_ms`) and its forward pass (`forward_ms`; for ddp and horovod that is the rank's own compute, since
their gradients are reduced in the backward; fsdp, tp and pp gather or reduce inside the forward, so there the slow
rank's forward makes the others' forwards as long, and only its data wait tells it apart). The loop times both per
step on every rank, at no cost to a step (two clock reads), and gathers them once an epoch with the epoch's
metrics; rank 0 logs them per rank and names a rank whose own time is more than `run.straggler_ratio` times the
median of the others'.
"""
from __future__ import annotations

from dataclasses import dataclass
import time
from statistics import median

STRAGGLER_TAG = "straggler"
# A rank's own time above the others' by less than this share of a step holds nobody up much (and on a short step
# is noise): it is not named whatever the ratio.
MIN_SHARE_OF_STEP = 0.1


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean times per step over an epoch's steps of this attempt, in milliseconds."""
    step_ms: float       # the whole step: waiting for the batch, forward, backward, optimizer step
    data_wait_ms: float  # waiting for the batch
    forward_ms: float    # the forward pass and loss (0: the backend does not time it)

    @property
    def own_ms(self) -> float:
        return self.data_wait_ms + self.forward_ms

    FIELDS = ("step_time_ms", "data_wait_ms", "forward_ms")

    def values(self) -> list[float]:
        return [self.step_ms, self.data_wait_ms, self.forward_ms]


def per_step(step_s: float, data_wait_s: float, forward_s: float, steps: int) -> RankTimes:
    """Seconds over `steps` steps as milliseconds per step (zeros for no steps)."""
    scale = 1000.0 / steps if steps else 0.0
    return RankTimes(step_s * scale, data_wait_s * scale, forward_s * scale)


def gathered(times: RankTimes, rank: int, world_size: int, reduce_sum) -> list[RankTimes]:
    """Every rank's `times`, by one all-reduce (`reduce_sum`: the backend's sum over ranks) of a vector in which
    each rank fills its own slots (collective)."""
    width = len(RankTimes.FIELDS)
    vector = [0.0] * (width * world_size)
    vector[rank * width:(rank + 1) * width] = times.values()
    summed = reduce_sum(vector)
    return [RankTimes(*summed[r * width:(r + 1) * width]) for r in range(world_size)]


def rank_metrics(times: list[RankTimes]) -> dict[str, float]:
    """`rank<r>.step_time_ms`, `rank<r>.data_wait_ms`, `rank<r>.forward_ms` for every rank."""
    return {f"rank{r}.{name}": value for r, each in enumerate(times)
            for name, value in zip(RankTimes.FIELDS, each.values())}


def stragglers(times: list[RankTimes], ratio: float) -> list[tuple[int, float, float]]:
    """(rank, its own ms a step, the median of the others') for each rank whose own time exceeds `ratio` times the
    others' median by at least a tenth of a step. `ratio` <= 0, or a single rank: none."""
    if ratio <= 0 or len(times) < 2:
        return []
    found = []
    for rank, each in enumerate(times):
        others = median(t.own_ms for r, t in enumerate(times) if r != rank)
        if each.own_ms > ratio * others and each.own_ms - others >= MIN_SHARE_OF_STEP * each.step_ms:
            found.append((rank, each.own_ms, others))
    return found


def straggler_line(epoch: int, times: list[RankTimes], found: list[tuple[int, float, float]], ratio: float) -> str:
    """One line naming the straggling ranks of `epoch` (the run's `rank<r>.node` tags say where each runs)."""
    parts = []
    for rank, own, others in found:
        parts.append(f"rank {rank}: {own:.1f} ms a step of its own (data wait {times[rank].data_wait_ms:.1f}, "
                     f"forward {times[rank].forward_ms:.1f}) against {others:.1f} ms for the other ranks")
    return (f"straggler in epoch {epoch}: " + "; ".join(parts) +
            f" (more than run.straggler_ratio={ratio:g} times; every rank waits for it at each step)")


@dataclass
class StepClock:
    """This attempt's part of an epoch, timed on this rank: steps, the seconds they took (waiting for batches
    included), the part spent waiting for batches and the part in the adapter's forward passes."""
    forward_at_start: float
    steps: int = 0
    step_s: float = 0.0
    data_wait_s: float = 0.0
    forward_s: float = 0.0

    def stop(self, started: float, forward_now: float) -> None:
        self.step_s = time.perf_counter() - started
        self.forward_s = forward_now - self.forward_at_start

    def means(self) -> RankTimes:
        return per_step(self.step_s, self.data_wait_s, self.forward_s, self.steps)
