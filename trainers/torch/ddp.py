"""PyTorch DistributedDataParallel on Ray Train (`TorchTrainer`): gloo on CPU, NCCL on GPU."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from contract.checkpoint import TrainState
from trainers import torch_common as tc
from trainers.loop import TrainLoop, WorkerContext
from trainers.models import build_model
from trainers.torch_recipe import build_recipe


def build_adapter(cfg: DictConfig, model_inputs: dict, rank: int, train_data: tc.TrainData, device: torch.device,
                  wrap: Callable[[nn.Module], nn.Module] | None = None) -> tc.TorchAdapter:
    """The plain model and optimizer, wrapped by `wrap` (Ray's `prepare_model`: DDP when world_size > 1), and
    this rank's shard, shuffled by its own seed."""
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = tc.place_model(build_model(cfg.model, model_inputs, seed=cfg.run.seed), device)
    train, evaluation = train_data(cfg.run.seed + 1000 * rank)
    recipe = build_recipe(model, cfg.trainer, train.steps(), device)
    model = wrap(model) if wrap is not None else model
    tc.seed_dropout(cfg.run.seed, rank)
    return tc.TorchAdapter(model, recipe, train, evaluation, device, rank)


def run_worker(cfg: DictConfig, ctx: WorkerContext, adapter: tc.TorchAdapter) -> bool:
    """The shared loop (through torch.compile if `trainer.compile`), then `run.dump_params_dir`. False: stopped
    on request."""
    if cfg.trainer.compile:
        adapter.compile_forward()
    if not TrainLoop(adapter, ctx).run():
        return False
    adapter.dump(cfg.run.dump_params_dir)
    return True


def run_mesh_worker(config: dict[str, Any], build: Callable[..., tc.TorchAdapter]) -> None:
    """What a worker of a backend on a device mesh (tp, fsdp) runs: its adapter from
    `build(cfg, model_inputs, rank, world_size, train_data, device)` on the shared loop."""
    import ray.train.torch

    from trainers.worker import ray_context, worker_config

    cfg = worker_config(config)
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    ctx = ray_context(config, cfg)
    adapter = build(cfg, config["model_inputs"], ctx.rank, ctx.world_size, lambda seed: tc.worker_data(cfg, seed),
                    ray.train.torch.get_device())
    run_worker(cfg, ctx, adapter)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train.torch

    from trainers.worker import ray_context, worker_config

    cfg = worker_config(config)
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    ctx = ray_context(config, cfg)
    adapter = build_adapter(cfg, config["model_inputs"], ctx.rank, lambda seed: tc.worker_data(cfg, seed),
                            ray.train.torch.get_device(), wrap=ray.train.torch.prepare_model)
    run_worker(cfg, ctx, adapter)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    return tc.torch_trainer(train_loop_per_worker, cfg, datasets, run_id, tracking_uri, model_inputs,
                            callbacks=callbacks)


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> None:
    """Log the trained (dense) model of the final checkpoint to the MLflow run (PyTorch flavour)."""
    from contract.tracking import log_torch_model

    model = build_model(cfg.model, model_inputs)
    with checkpoint.as_directory() as directory:
        model.load_state_dict(tc.load_state_file(directory)["model"])
        epoch = TrainState.read(directory).epoch
    log_torch_model(uri, run_id, model.eval(), example_input(cfg.data.name, model_inputs), epoch)


def example_input(dataset: str, model_inputs: dict) -> Any:
    if dataset == "imdb":
        return np.ones((2, model_inputs["max_len"]), dtype=np.int64)  # token ids; [PAD] ids are the padding
    return np.zeros((2, 784), dtype=np.float32)
