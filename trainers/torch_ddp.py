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

    cfg = OmegaConf.create(config["cfg"])
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts them)

    model = build_model(cfg.model, config["model_inputs"])
    optimizer = tc.make_optimizer(model, cfg.trainer.optimizer, cfg.trainer.lr)
    state = tc.load_checkpoint(ray.train.get_checkpoint())
    start_epoch, partial = tc.resume_point(state)
    last_metrics = None if state is None else state["metrics"]
    if state is not None:
        model.load_state_dict(state["model"])
        if state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
    model = ray.train.torch.prepare_model(model)  # wraps in DDP when world_size > 1
    device = ray.train.torch.get_device()

    train, test = tc.worker_data(cfg, seed=cfg.run.seed + 1000 * rank)
    logger = tc.rank0_logger(config, rank, state)
    tc.tag_worker_node(config, rank)
    should_stop = tc.StopCheck(cfg.run.resume_dir)

    for epoch in range(start_epoch, cfg.trainer.epochs + 1):
        tc.maybe_inject_failure(cfg.fault, epoch, rank, world_size)
        max_steps = cfg.trainer.max_steps_per_epoch
        stats = tc.epoch_start(partial, epoch)
        on_step = tc.step_loss_logger(logger, cfg.trainer.log_every_n_steps, epoch, train.steps(max_steps),
                                      done=stats.steps)
        batches = train.epoch(epoch, max_steps=max_steps, skip=stats.steps)
        stats = tc.train_epoch(model, optimizer, batches, device, on_step=on_step, stats=stats,
                               should_stop=should_stop)
        if stats.stopped:
            tc.report_stop(stats, epoch, last_metrics, tc.unwrap(model).state_dict(), optimizer.state_dict(), rank)
            return
        correct, total = tc.count_correct(model, test.epoch(epoch, shuffle=False), device)
        metrics = tc.epoch_metrics(stats, correct, total)
        if epoch == start_epoch:
            metrics["data_load_s"] = train.load_s + test.load_s
        tc.report_epoch(metrics, tc.unwrap(model).state_dict(), optimizer.state_dict(), epoch, rank)
        last_metrics = metrics
        if logger is not None:
            logger.log(epoch, metrics)
    tc.dump_state(cfg.run.dump_params_dir, tc.unwrap(model).state_dict(), rank, train)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    return tc.torch_trainer(train_loop_per_worker, cfg, datasets, run_id, tracking_uri, model_inputs,
                            callbacks=callbacks)


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> None:
    """Log the trained (dense) model of the final checkpoint to the MLflow run (PyTorch flavour)."""
    from pipelines.tracking import log_torch_model

    model = build_model(cfg.model, model_inputs)
    model.load_state_dict(tc.load_checkpoint(checkpoint)["model"])
    log_torch_model(uri, run_id, model.eval(), example_input(cfg.data.name, model_inputs))


def example_input(dataset: str, model_inputs: dict) -> Any:
    if dataset == "imdb":
        return np.ones((2, model_inputs["max_len"]), dtype=np.int64)  # token ids; no mask = all tokens
    return np.zeros((2, 784), dtype=np.float32)
