"""trainer=lightning on Ray Train, as the driver sees it (Lightning is imported on the workers only): the
`TorchTrainer` every PyTorch backend uses, whose workers run Lightning's Trainer (trainers/torch/lightning_fit.py),
and the final model logged from Lightning's checkpoint."""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from contract.data import DataSchema
from trainers.models import build_lightning_module, has_builder
from trainers.torch import common as tc
from trainers.torch.lightning_checkpoint import module_state, plain_model_state

def train_loop_per_worker(config: dict[str, Any]) -> None:
    from trainers.torch import lightning_fit

    tc.run_on_ray(config, lightning_fit.run_on_ray)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, inputs: DataSchema,
                  callbacks: list | None = None):
    return tc.torch_trainer(train_loop_per_worker, cfg, datasets, run_id, tracking_uri, inputs, callbacks=callbacks)


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, inputs: DataSchema) -> None:
    """The trained model to the MLflow run (PyTorch flavour): the spec's plain model, as trainer=ddp logs it, or
    the spec's own LightningModule (its `forward` takes the same inputs)."""
    if not has_builder(cfg.model, "lightning"):
        tc.log_final_model(uri, run_id, cfg, checkpoint, inputs, model_state=plain_model_state)
        return
    from contract.checkpoint import TrainState
    from contract.tracking import log_torch_model

    module = build_lightning_module(cfg.model, inputs)
    with checkpoint.as_directory() as directory:
        module.load_state_dict(module_state(directory))
        epoch = TrainState.read(directory).epoch
    log_torch_model(uri, run_id, tc.logged_form(module, inputs), tc.example_input(inputs), epoch)
