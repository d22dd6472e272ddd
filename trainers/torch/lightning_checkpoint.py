"""What a trainer=lightning checkpoint folder holds beside `train_state.json`, and how to read the model out of it
without Lightning: `lightning.ckpt`, Lightning's own checkpoint (`Trainer.save_checkpoint`: the LightningModule's
state dict, optimizer and schedule, Lightning's loop counters)."""
from __future__ import annotations

import torch

CHECKPOINT_FILE = "lightning.ckpt"
PLAIN_MODEL = "model."  # where `RecipeModule` (lightning_module.py) keeps the spec's plain model in its state dict


def module_state(directory: str) -> dict[str, torch.Tensor]:
    """The LightningModule's state dict in a checkpoint folder."""
    return torch.load(f"{directory}/{CHECKPOINT_FILE}", map_location="cpu", weights_only=False)["state_dict"]


def plain_model_state(directory: str) -> dict[str, torch.Tensor]:
    """The spec's plain model's state dict, out of the `RecipeModule` a checkpoint folder holds."""
    return {key[len(PLAIN_MODEL):]: value for key, value in module_state(directory).items()
            if key.startswith(PLAIN_MODEL)}
