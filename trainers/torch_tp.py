"""Tensor parallelism (Megatron-style layers or torch DTensor plans) x data parallelism on Ray Train.

Every worker builds the same dense model from the same seed, `parallelize_bert` shards it over the "tp" mesh
dimension, and gradients are averaged over the "dp" dimension. Checkpoints hold the dense (unsharded) model, so
a run can resume with another tp.
"""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from trainers import torch_common as tc
from trainers.models import build_model
from trainers.torch_ddp import log_final_model  # noqa: F401  (re-exported: checkpoints hold the dense model)


class CollectiveTimer:
    """Wall time spent inside torch.distributed collectives called by Python code on this rank (our Megatron
    layers and the DP gradient sync; DTensor's functional collectives are not seen)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def patch(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in self.NAMES}

        def timed(fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return wrapper

        for name, fn in originals.items():
            setattr(dist, name, timed(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def rank_stats(model: torch.nn.Module, collective_s: float, use_gpu: bool) -> dict[str, float]:
    """This rank's share of the model and its resources."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    peak = (torch.cuda.max_memory_allocated() if use_gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
    return {"param_count": float(sum(p.numel() for p in local)),
            "param_bytes": float(sum(p.numel() * p.element_size() for p in local)),
            "peak_memory_bytes": float(peak), "collective_time_s": collective_s}


def log_rank_stats(logger: Any, stats: dict[str, float], epoch: int) -> None:
    """Gather every rank's stats; rank 0 logs them as `rank<r>.<name>` metrics."""
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    if logger is not None:
        logger.log_extra(epoch, {f"rank{r}.{k}": v for r, s in enumerate(gathered) for k, v in s.items()})


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from trainers.parallel.data_parallel import average_gradients
    from trainers.parallel.mesh import ParallelDims, build_mesh, rank_coords
    from trainers.parallel.plans import parallelize_bert, unshard_state_dict

    cfg = OmegaConf.create(config["cfg"])
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    dims = ParallelDims(dp=cfg.trainer.dp, tp=cfg.trainer.tp)
    dims.validate(world_size)
    dp_rank, _ = rank_coords(rank, dims.dp, dims.tp)
    mesh = build_mesh(dims, "cuda" if cfg.trainer.use_gpu else "cpu")
    device = ray.train.torch.get_device()

    # Same seed everywhere: identical dense weights before sharding, identical dropout masks inside a TP group.
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, config["model_inputs"])
    state = tc.load_checkpoint(ray.train.get_checkpoint())
    start_epoch, partial = tc.resume_point(state)
    last_metrics = None if state is None else state["metrics"]
    if state is not None:  # dense weights: whatever tp the checkpoint was written with
        model.load_state_dict(state["model"])
    model = parallelize_bert(model.to(device), mesh, impl=cfg.trainer.tp_impl)
    optimizer = tc.make_optimizer(model, cfg.trainer.optimizer, cfg.trainer.lr)
    dp_group = mesh.get_group("dp")

    train, test = tc.worker_data(cfg, seed=cfg.run.seed + 1000 * dp_rank)  # same shuffle in a TP group
    logger = tc.rank0_logger(config, rank, state)
    tc.tag_worker_node(config, rank)
    should_stop = tc.StopCheck(cfg.run.resume_dir)

    timer = CollectiveTimer()
    for epoch in range(start_epoch, cfg.trainer.epochs + 1):
        tc.maybe_inject_failure(cfg.fault, epoch, rank, world_size)
        max_steps = cfg.trainer.max_steps_per_epoch
        stats = tc.epoch_start(partial, epoch)
        on_step = tc.step_loss_logger(logger, cfg.trainer.log_every_n_steps, epoch, train.steps(max_steps),
                                      done=stats.steps)
        batches = train.epoch(epoch, max_steps=max_steps, skip=stats.steps)
        with timer.patch():  # training steps only, so collective time compares with train time
            stats = tc.train_epoch(model, optimizer, batches, device, on_step=on_step, stats=stats,
                                   after_backward=lambda: average_gradients(model, dp_group),
                                   should_stop=should_stop)
        if stats.stopped:
            tc.report_stop(stats, epoch, last_metrics, unshard_state_dict(model), None, rank)
            return
        correct, total = tc.count_correct(model, test.epoch(epoch, shuffle=False), device)
        metrics = tc.epoch_metrics(stats, correct, total, replicas=dims.tp)
        if epoch == start_epoch:
            metrics["data_load_s"] = train.load_s + test.load_s
        log_rank_stats(logger, rank_stats(model, timer.seconds, cfg.trainer.use_gpu), epoch)
        dense = unshard_state_dict(model)  # a collective: every rank takes part, rank 0 saves
        # Optimizer state is sharded like the model; it is not saved, so a resumed run restarts Adam's moments.
        tc.report_epoch(metrics, dense, None, epoch, rank)
        last_metrics = metrics
        if logger is not None:
            logger.log(epoch, metrics)
    if cfg.run.dump_params_dir:
        tc.dump_state(cfg.run.dump_params_dir, unshard_state_dict(model), rank, train)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    from trainers.shard_data import OrderedShards

    return tc.torch_trainer(train_loop_per_worker, cfg, datasets, run_id, tracking_uri, model_inputs,
                            dataset_config=OrderedShards(dp=cfg.trainer.dp, tp=cfg.trainer.tp),
                            callbacks=callbacks)
