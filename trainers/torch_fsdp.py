"""FSDP2 sharded data parallelism on Ray Train (`TorchTrainer`; gloo on CPU, NCCL on GPU).

Every worker builds the same dense model from the same seed and `parallelize_fsdp` shards it (trainers/parallel/
fsdp.py); each worker reads its own data shard, as under DDP, so the run trains what DDP with the same workers
trains, holding ~1/N of the parameters, gradients and optimizer state per worker (logged each epoch as
`rank<r>.param_bytes`, `grad_bytes`, `optimizer_state_bytes`). With `trainer.tp` > 1 (the BERT model) the model is
first tensor-parallel with torch's DTensor plans inside groups of tp consecutive workers, which read the same
batches, and FSDP shards over the rest (FSDP x TP).

Checkpoints are sharded: `torch.distributed.checkpoint` (DCP) writes each rank's shards of the model and optimizer
state into that rank's folder (no gather to rank 0) and Ray Train merges the folders; the schedule's state and
`train_state.json` come from rank 0. DCP's metadata places every shard, so a checkpoint loads at another number of
workers (resharded on load). The final model is exported dense from the checkpoint for MLflow.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from omegaconf import DictConfig

from trainers import torch_common as tc
from trainers.models import build_model
from trainers.torch_ddp import example_input, run_mesh_worker
from trainers.torch_recipe import build_recipe

RECIPE_FILE = "recipe.pt"  # the schedule's (and scaler's) state, from rank 0, beside DCP's files


class FSDPAdapter(tc.TorchAdapter):
    """The loop's adapter for an FSDP2 model: sharded checkpoints. Gradient sync is FSDP's own reduce-scatter in
    backward; clipping takes the global norm of the sharded gradients (trainers/parallel/grad_norm.py
    `clip_dtensor_grad_norm`); every rank's memory is in the epoch extras, as for every PyTorch backend."""

    sharded_checkpoint = True

    def save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        if self.rank == 0:
            torch.save(self.recipe.state_dict(), os.path.join(directory, RECIPE_FILE))

    def load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=directory)  # into this rank's shards, whatever the saving layout was
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.recipe.load_state_dict(torch.load(os.path.join(directory, RECIPE_FILE), weights_only=False))

    def dense_model_state(self) -> dict[str, torch.Tensor]:
        """The full model on every rank (collective: all-gathers the shards)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def build_adapter(cfg: DictConfig, model_inputs: dict, rank: int, world_size: int, train_data: tc.TrainData,
                  device: torch.device) -> FSDPAdapter:
    """The dense model from the shared seed, tensor-parallel over "tp" (if tp > 1), then sharded over the
    data-parallel dimensions; this rank's data-parallel shard, shuffled by its seed (alike in a TP group)."""
    from trainers.parallel.fsdp import (apply_activation_checkpointing, build_fsdp_mesh, data_parallel_mesh,
                                        parallelize_fsdp)
    from trainers.parallel.grad_norm import clip_dtensor_grad_norm
    from trainers.parallel.plans import parallelize_bert

    trainer = cfg.trainer
    dp_shard = world_size // trainer.tp // trainer.dp_replicate
    mesh = build_fsdp_mesh(trainer.dp_replicate, dp_shard, trainer.tp, device.type)
    # The same dense weights on every rank before each keeps its shard, and the same dropout masks in a TP group.
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, model_inputs).to(device)
    if trainer.tp > 1:
        model = parallelize_bert(model, mesh, impl="dtensor")
    if trainer.activation_checkpointing:
        model = apply_activation_checkpointing(model)
    model = parallelize_fsdp(model, data_parallel_mesh(mesh), trainer.reshard_after_forward)
    train, evaluation = train_data(cfg.run.seed + 1000 * (rank // trainer.tp))
    recipe = build_recipe(model, trainer, train.steps(), device)  # over the sharded parameters
    return FSDPAdapter(model, recipe, train, evaluation, device, rank, replicas=trainer.tp,
                       clip=lambda max_norm: clip_dtensor_grad_norm(model, max_norm))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    run_mesh_worker(config, build_adapter)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    from trainers.shard_data import shard_config

    trainer = cfg.trainer
    return tc.torch_trainer(train_loop_per_worker, cfg, datasets, run_id, tracking_uri, model_inputs,
                            dataset_config=shard_config(trainer.num_workers, cfg.data.cache_in_worker, trainer.tp),
                            callbacks=callbacks)


def dense_model_state(directory: str) -> dict[str, torch.Tensor]:
    """The full model of a sharded checkpoint, read in this one process (DCP's `dcp_to_torch_save`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "dense.pt")
        dcp_to_torch_save(directory, path)
        return torch.load(path, weights_only=False)["model"]


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> None:
    """Log the final checkpoint's model, exported dense, to the MLflow run (PyTorch flavour)."""
    from contract.tracking import log_torch_model

    model = build_model(cfg.model, model_inputs)
    with checkpoint.as_directory() as directory:
        model.load_state_dict(dense_model_state(directory))
    log_torch_model(uri, run_id, model.eval(), example_input(cfg.data.name, model_inputs))
