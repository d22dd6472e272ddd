"""The hang watcher's marks: where this rank is, as the loop goes (contract/hang.py `Progress`, read by the watcher
thread of trainers/hang_watch.py)."""
from __future__ import annotations

from contract.hang import Progress
from trainers.callbacks.base import LoopCallback


class HangMarks(LoopCallback):
    def __init__(self, progress: Progress):
        self.progress = progress

    def on_phase(self, epoch: int, step: int, phase: str) -> None:
        self.progress.at(epoch, step, phase)
