"""The hang watchdog's shared part: where each rank is, and the verdict when none of them moves.

The loop marks each rank's position as it goes (`Progress.at`: epoch, step, phase; an attribute write, no
synchronisation and no collective). Each rank's watcher thread (trainers/hang_watch.py) publishes its position as a
small file in the run's folder on shared storage (`progress/rank<r>.json`) and reads the others'. When no rank's
position has changed for `fault.hang_timeout_s`, every rank dumps its stacks into `hang/rank<r>.txt`, writes the
verdict (`hang/verdict-<attempt>.json`) and ends its process: Ray Train restarts the workers from the last
checkpoint as for any failure (`fault.max_failures`), and the driver logs the `hang/` folder to the MLflow run with
the verdict as the `hang` tag.

The stuck ranks are the ones furthest behind: in a collective every other rank waits inside it, so the rank that
never arrived is the one at an earlier step or phase. When every rank is at the same point, all are named.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from contract.files import write_atomically

# Phases in the order a step, then an epoch's end, goes through them.
PHASES = ("start", "restore", "data", "step", "evaluate", "metrics", "checkpoint")
# Phases the watcher waits out: a worker's start before its loop (pulling its data shard, building the model: as
# long as the data is large), and Keras `fit`, which runs an epoch in one call with no marks inside.
UNWATCHED = ("start", "fit")
PROGRESS_DIR, HANG_DIR = "progress", "hang"
HANG_EXIT_CODE = 75  # a worker that ended itself on a hang verdict


@dataclass(frozen=True)
class Position:
    epoch: int
    step: int   # of the epoch, 1-based: the step being fetched or trained
    phase: str

    def order(self) -> tuple[int, int, int]:
        return self.epoch, self.step, PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)

    def describe(self) -> str:
        return f"epoch {self.epoch} step {self.step} ({self.phase})"


class Progress:
    """This rank's position, set by the loop, read by its watcher thread: one tuple assignment (atomic; twice a
    step costs a step nothing measurable: benchmarks/README.md, hang_watch). `on_hang`: what a backend adds to the
    stacks when the watcher fires, each called with (the run's hang/ folder, rank), e.g. NCCL's Flight Recorder."""
    watched = True

    def __init__(self) -> None:
        self.where = (0, 0, "start")
        self.on_hang: list[Callable[[Path, int], None]] = []

    def at(self, epoch: int, step: int, phase: str) -> None:
        self.where = (epoch, step, phase)

    def position(self) -> Position:
        return Position(*self.where)


class NoProgress(Progress):
    """Where nothing watches (in-process tests, hang_timeout_s=0)."""
    watched = False

    def at(self, epoch: int, step: int, phase: str) -> None:
        pass


@dataclass(frozen=True)
class HangVerdict:
    idle_s: float
    world_size: int
    positions: dict[int, Position]  # the ranks that published one

    @property
    def stuck(self) -> list[int]:
        """Ranks that never published a position, else those furthest behind."""
        missing = [r for r in range(self.world_size) if r not in self.positions]
        if missing:
            return missing
        last = min(p.order() for p in self.positions.values())
        return sorted(r for r, p in self.positions.items() if p.order() == last)

    def line(self) -> str:
        stuck = self.stuck
        who = "every rank" if len(stuck) == self.world_size > 1 else \
            ("rank " if len(stuck) == 1 else "ranks ") + ", ".join(map(str, stuck))
        where = "; ".join(f"rank {r} at {self.positions[r].describe()}" if r in self.positions else
                          f"rank {r} never reached the training loop" for r in range(self.world_size))
        return f"hang: no rank advanced for {self.idle_s:.0f} s; stuck: {who} ({where}); stacks: the run's hang/ " \
               f"artifacts"

    def to_dict(self) -> dict:
        return {"idle_s": self.idle_s, "world_size": self.world_size, "stuck": self.stuck, "line": self.line(),
                "positions": {str(r): [p.epoch, p.step, p.phase] for r, p in self.positions.items()}}


def publish(folder: Path, rank: int, attempt: str, where: Position) -> None:
    write_atomically(folder / PROGRESS_DIR / f"rank{rank}.json",
                     json.dumps({"attempt": attempt, "where": [where.epoch, where.step, where.phase]}))


def read_positions(folder: Path, attempt: str, world_size: int) -> dict[int, Position]:
    """The published positions of this attempt's ranks (an earlier attempt's files are skipped)."""
    positions = {}
    for rank in range(world_size):
        try:
            record = json.loads((folder / PROGRESS_DIR / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue  # not written yet, or being replaced
        if record.get("attempt") == attempt:
            positions[rank] = Position(*record["where"])
    return positions


def read_verdicts(folder: Path) -> list[dict]:
    """Every attempt's hang verdict in the run's folder, oldest first."""
    files = sorted((folder / HANG_DIR).glob("verdict-*.json"), key=lambda f: f.stat().st_mtime)
    verdicts = []
    for file in files:
        try:
            verdicts.append(json.loads(file.read_text()))
        except (OSError, ValueError):
            continue
    return verdicts
