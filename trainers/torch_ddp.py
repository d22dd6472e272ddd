"""PyTorch DistributedDataParallel on Ray Train (`TorchTrainer`): gloo on CPU, NCCL on GPU."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from trainers.models import build_model
from trainers import torch_common as tc


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from pipelines.tracking import EpochLogger

    cfg = OmegaConf.create(config["cfg"])
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts them)

    model = build_model(cfg.model, config["model_inputs"])
    optimizer = tc.make_optimizer(model, cfg.trainer.optimizer, cfg.trainer.lr)
    start_epoch = 1
    state = tc.load_checkpoint(ray.train.get_checkpoint())
    if state is not None:
        model.load_state_dict(state["model"])
        if state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)  # wraps in DDP when world_size > 1
    device = ray.train.torch.get_device()

    seed = cfg.run.seed + 1000 * rank
    train = tc.ShardBatches(ray.train.get_dataset_shard("train"), cfg.data.name, cfg.trainer.batch_size,
                            cfg.data.cache_in_worker, seed)
    test = tc.ShardBatches(ray.train.get_dataset_shard("eval"), cfg.data.name, 256, cfg.data.cache_in_worker,
                           seed)
    logger = EpochLogger(config["tracking_uri"], config["run_id"]) if rank == 0 else None
    if logger is not None and state is not None:
        logger.resumed_from(state["epoch"])
        logger.log(state["epoch"], state["metrics"])  # in case the failure hit between report and log

    for epoch in range(start_epoch, cfg.trainer.epochs + 1):
        tc.maybe_inject_failure(cfg.fault, epoch, rank, world_size)
        max_steps = cfg.trainer.max_steps_per_epoch
        on_step = tc.step_loss_logger(logger, cfg.trainer.log_every_n_steps, epoch, train.steps(max_steps))
        stats = tc.train_epoch(model, optimizer, train.epoch(epoch, max_steps=max_steps), device, on_step=on_step)
        correct, total = tc.count_correct(model, test.epoch(epoch, shuffle=False), device)
        metrics = tc.epoch_metrics(stats, correct, total)
        if epoch == start_epoch:
            metrics["data_load_s"] = train.load_s + test.load_s
        tc.report_epoch(metrics, tc.unwrap(model).state_dict(), optimizer.state_dict(), epoch, rank)
        if logger is not None:
            logger.log(epoch, metrics)
    tc.dump_state(cfg.run.dump_params_dir, tc.unwrap(model).state_dict(), rank, train)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    use_gpu = cfg.trainer.use_gpu
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "tracking_uri": tracking_uri, "model_inputs": model_inputs},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.trainer.num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cfg.trainer.threads_per_worker}),
        run_config=RunConfig(name=f"run-{run_id}", storage_path=cfg.run.storage_path,
                             failure_config=FailureConfig(max_failures=cfg.fault.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
        datasets=datasets,
    )


def load_final_model(cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> tuple[torch.nn.Module, Any]:
    """The trained model from the final checkpoint, and an input example for MLflow's signature."""
    model = build_model(cfg.model, model_inputs)
    model.load_state_dict(tc.load_checkpoint(checkpoint)["model"])
    return model.eval(), example_input(cfg.data.name, model_inputs)


def example_input(dataset: str, model_inputs: dict) -> Any:
    if dataset == "imdb":
        return np.ones((2, model_inputs["max_len"]), dtype=np.int64)  # token ids; no mask = all tokens
    return np.zeros((2, 784), dtype=np.float32)
