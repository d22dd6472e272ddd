"""Where a run's loss stopped being a number, written into the run's folder (rank 0): the driver reads it and fails
the run (pipelines/fit.py)."""
from __future__ import annotations

import json
from pathlib import Path

from contract.metrics import DIVERGED_FILE
from trainers.callbacks.base import LoopCallback


class DivergenceFile(LoopCallback):
    def __init__(self, run_folder: Path):
        self.run_folder = run_folder

    def on_diverged(self, where: dict[str, float]) -> None:
        self.run_folder.mkdir(parents=True, exist_ok=True)
        (self.run_folder / DIVERGED_FILE).write_text(json.dumps(where))
