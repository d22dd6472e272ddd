"""The pipeline schedules' names and how many stages each runs on a rank, without torch: the config checks read
them before any worker (or torch) starts (trainers/torch/parallel/pipeline.py builds the schedules)."""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def stages_per_rank(schedule: str) -> int:
    """Interleaved 1F1B runs two (virtual) stages on every rank; the others one."""
    return 2 if schedule == "interleaved_1f1b" else 1
