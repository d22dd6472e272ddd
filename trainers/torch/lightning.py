"""trainer=lightning: PyTorch Lightning's `Trainer` on Ray Train's workers (trainers/torch/lightning_fit.py, through
Ray's Lightning integration), handing its steps and epochs to the shared loop. This module is what the driver
imports: Lightning itself is imported on the workers only (and where a model spec's own LightningModule is logged)."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from contract.data import DataSchema
from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.models import build_lightning_module, has_builder
from trainers.torch.backend import TorchBackend, log_torch_model
from trainers.torch.lightning_checkpoint import module_state, plain_model_state


class Lightning(TorchBackend):
    """Lightning keeps its own loop: `run_worker` is its `Trainer.fit`, with Ray's Lightning strategy."""

    def run_worker(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
        from trainers.torch import lightning_fit

        return lightning_fit.run_on_ray(cfg, ctx, data)

    def dense_state(self, directory: str) -> dict[str, Any]:
        """The spec's plain model, out of the `RecipeModule` Lightning's checkpoint holds."""
        return plain_model_state(directory)

    def log_final_model(self, tracking_uri: str, run_id: str, cfg: DictConfig, checkpoint: Any,
                        inputs: DataSchema) -> None:
        """The spec's plain model, as trainer=ddp logs it, or the spec's own LightningModule (its `forward` takes
        the same inputs), in MLflow's PyTorch flavour."""
        if not has_builder(cfg.model, "lightning"):
            super().log_final_model(tracking_uri, run_id, cfg, checkpoint, inputs)
            return
        module = build_lightning_module(cfg.model, inputs)
        with checkpoint.as_directory() as directory:
            module.load_state_dict(module_state(directory))
        log_torch_model(tracking_uri, run_id, module, inputs, checkpoint)
