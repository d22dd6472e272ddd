"""Each epoch's FLOPs achieved (`tflops_per_rank`) and, where the device's peak is known, `mfu`
(contract/mfu.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from contract.mfu import utilisation
from trainers.callbacks.base import LoopCallback

if TYPE_CHECKING:
    from trainers.loop import TrainLoop


class Utilisation(LoopCallback):
    """`flops_per_sample`: the model's training FLOPs per sample; `peak_flops`: one device's peak FLOP/s at the
    run's precision, if known."""

    def __init__(self, flops_per_sample: float, peak_flops: float | None = None):
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops

    def on_start(self, loop: TrainLoop) -> None:
        self.world_size = loop.ctx.world_size

    def epoch_extras(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        return utilisation(self.flops_per_sample, metrics["samples_per_s"], self.world_size, self.peak_flops)
