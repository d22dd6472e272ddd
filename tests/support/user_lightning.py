"""A user's own LightningModule, registered as a model spec (`lightning=`) as a user's plugin would register it:
its own `training_step` (cross-entropy with label smoothing) and `configure_optimizers` (plain SGD at `model.lr`),
which trainer=lightning trains instead of this project's recipe, and whose `lr` PBT may mutate."""
from __future__ import annotations

from dataclasses import dataclass

from contract.registry import ModelSpec, register_model


@dataclass
class SmoothedMLPConfig:
    name: str = "smoothed_mlp"  # a user's LightningModule
    hidden: int = 32            # its hidden width
    lr: float = 0.1             # its own optimizer's learning rate


def build_module(cfg, inputs, seed):
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class SmoothedMLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(inputs.features.width, cfg.hidden), nn.ReLU(),
                                     nn.Linear(cfg.hidden, inputs.target.outputs))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            (x,), y = batch
            return nn.functional.cross_entropy(self(x), y, label_smoothing=0.1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg.lr)

    return SmoothedMLP()


register_model(ModelSpec("smoothed_mlp", SmoothedMLPConfig, "a user's LightningModule", inputs=("image", "numeric"),
                         tasks=("classification",), lightning=build_module,
                         mutable=("lr",)))  # PBT may change its rate: a resumed module takes its config's
