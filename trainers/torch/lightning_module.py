"""The LightningModule a model spec without its own (`ModelSpec.lightning`) trains as under trainer=lightning: the
spec's plain PyTorch model, the task's loss, and this project's recipe (trainers/torch/recipe.py): the optimizer and
its weight-decay groups, the schedule stepped per optimizer step. Lightning's Trainer applies the rest of the recipe
(clipping, accumulation, precision: trainers/torch/lightning_fit.py), so the same config trains the same curve
as trainer=ddp."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from trainers.torch.recipe import task_loss
from trainers.torch.recipe import TorchRecipe, build_recipe


class RecipeModule(pl.LightningModule):
    """`model` trained on `task`'s loss with `trainer`'s recipe over `steps_per_epoch` batches an epoch. Batches are
    (inputs, targets); `forward` is the model's, so evaluation and the logged model take the inputs alone."""

    def __init__(self, model: nn.Module, task: str, trainer: Any, steps_per_epoch: int):
        super().__init__()
        self.model, self.loss_fn = model, task_loss(task)
        self.trainer_cfg, self.steps_per_epoch = trainer, steps_per_epoch
        self.recipe: TorchRecipe | None = None

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs)

    def training_step(self, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.loss_fn(self.model(*inputs), targets)

    def configure_optimizers(self) -> dict[str, Any]:
        trainer = self.trainer_cfg
        # Lightning refuses to clip a fused optimizer's gradients under mixed precision (it unscales in its step)
        fused = trainer.grad_clip is None or trainer.precision == "fp32"
        self.recipe = build_recipe(self.model, trainer, self.steps_per_epoch, self.device, fused=fused)
        return {"optimizer": self.recipe.optimizer,
                "lr_scheduler": {"scheduler": self.recipe.scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """After Lightning restored a checkpoint: the hyperparameters are this config's, not the checkpoint's (a
        PBT trial continuing another's checkpoint with a mutated lr), as every backend resumes."""
        self.recipe.load_state_dict({})
