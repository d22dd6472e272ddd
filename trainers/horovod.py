"""Horovod (Gloo, CPU) on Ray Train V2: `DataParallelTrainer` + `HorovodConfig` (trainers/horovod_backend.py).

`trainer.framework` picks the binding: `torch` (`hvd.DistributedOptimizer`, any of our PyTorch models, MNIST or
IMDb) or `tf` (a custom loop on `hvd.DistributedGradientTape`, tf-keras MLP/CNN on MNIST; trainers/horovod_tf.py).
Same data (Ray Data shards), metric names, checkpoints and MLflow contract as the other backends: the PyTorch side
reuses torch_common and torch_ddp's logged model, the TF side tf_mwms' checkpoint format and logged model.

Options: `trainer.compression` (none | fp16: gradients travel as float16) and `trainer.backward_passes_per_step`
(k: gradients of k batches are accumulated locally and all-reduced once, one optimizer step per k batches).
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainers import torch_common as tc
from trainers.horovod_backend import HorovodConfig
from trainers.models import build_model

BUILD_HINT = "horovod is not installed in this environment; build it with `bash cluster/local/build-horovod.sh`"


def import_horovod(framework: str) -> Any:
    """`horovod.torch` or `horovod.tensorflow`, with the build hint instead of a bare ModuleNotFoundError."""
    import importlib

    try:
        return importlib.import_module({"torch": "horovod.torch", "tf": "horovod.tensorflow"}[framework])
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("horovod"):
            raise ModuleNotFoundError(BUILD_HINT) from err
        raise


def init_horovod(hvd: Any) -> tuple[int, int]:
    """`hvd.init()` (Gloo rendezvous with the server the backend started); checks Horovod agrees with Ray on
    who is who, since checkpoints and MLflow logging are done by Ray's rank 0."""
    import ray.train

    hvd.init()
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    if (hvd.rank(), hvd.size()) != (rank, size):
        raise RuntimeError(f"horovod rank/size {hvd.rank()}/{hvd.size()} != Ray Train's {rank}/{size}")
    return rank, size


def record_init(directory: str | None, rank: int) -> None:
    """`run.dump_params_dir` debugging aid: one line per `hvd.init()` (rank, pid, rendezvous address), so a test
    can see that a restarted worker group did its own rendezvous."""
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    line = (f"rank={rank} pid={os.getpid()} rendezvous={os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
            f"{os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT']} iface={os.environ.get('HOROVOD_GLOO_IFACE')}\n")
    with open(Path(directory) / "horovod_init.log", "a") as log:
        log.write(line)


def hvd_reducer(hvd: Any) -> tc.Reducer:
    """`torch_common.Reducer` over Horovod's allreduce (for the shared epoch metrics)."""
    ops = {"sum": hvd.Sum, "max": hvd.Max}
    calls = itertools.count()

    def reduce(values: list[float], op: str) -> list[float]:
        # Named ops: every rank issues them in the same order, so the same counter value names the same op.
        reduced = hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=ops[op], name=f"metrics.{next(calls)}")
        return reduced.tolist()
    return reduce


def distributed_optimizer(hvd: Any, model: nn.Module, cfg: DictConfig, state: dict | None) -> Any:
    """Wrap, then restore (wrapping builds a fresh optimizer from the param groups, dropping any state), then
    broadcast rank 0's weights and, when resuming, its optimizer state. On a fresh start every rank's optimizer
    is empty: Horovod's broadcast of an empty state would take a zero-gradient step to create it, which would
    count as an Adam step, so it is skipped."""
    optimizer = hvd.DistributedOptimizer(
        tc.make_optimizer(model, cfg.trainer.optimizer, cfg.trainer.lr), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if cfg.trainer.compression == "fp16" else hvd.Compression.none,
        backward_passes_per_step=cfg.trainer.backward_passes_per_step)
    if state is not None:
        model.load_state_dict(state["model"])
        if state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if state is not None:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return optimizer


def torch_loop(config: dict[str, Any], cfg: DictConfig) -> None:
    """The same epoch loop as torch_ddp (stop/resume included), with Horovod's optimizer and collectives."""
    import ray.train

    hvd = import_horovod("torch")
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    rank, world_size = init_horovod(hvd)
    record_init(cfg.run.dump_params_dir, rank)
    torch.manual_seed(cfg.run.seed + rank)  # different on purpose: broadcast_parameters must align them
    model = build_model(cfg.model, config["model_inputs"])
    state = tc.load_checkpoint(ray.train.get_checkpoint())
    optimizer = distributed_optimizer(hvd, model, cfg, state)
    start_epoch, partial = tc.resume_point(state)
    last_metrics = None if state is None else state["metrics"]
    train, test = tc.worker_data(cfg, seed=cfg.run.seed + 1000 * rank)
    logger = tc.rank0_logger(config, rank, state)
    tc.tag_worker_node(config, rank)
    reduce = hvd_reducer(hvd)
    should_stop = tc.StopCheck(cfg.run.resume_dir, reduce=reduce)
    cpu = torch.device("cpu")

    for epoch in range(start_epoch, cfg.trainer.epochs + 1):
        tc.maybe_inject_failure(cfg.fault, epoch, rank, world_size)
        max_steps = cfg.trainer.max_steps_per_epoch
        stats = tc.epoch_start(partial, epoch)
        on_step = tc.step_loss_logger(logger, cfg.trainer.log_every_n_steps, epoch, train.steps(max_steps),
                                      done=stats.steps)
        batches = train.epoch(epoch, max_steps=max_steps, skip=stats.steps)
        stats = tc.train_epoch(model, optimizer, batches, cpu, on_step=on_step, stats=stats,
                               should_stop=should_stop, passes=cfg.trainer.backward_passes_per_step)
        if stats.stopped:
            tc.report_stop(stats, epoch, last_metrics, model.state_dict(), optimizer.state_dict(), rank)
            return
        correct, total = tc.count_correct(model, test.epoch(epoch, shuffle=False), cpu)
        metrics = tc.epoch_metrics(stats, correct, total, reduce=reduce)
        if epoch == start_epoch:
            metrics["data_load_s"] = train.load_s + test.load_s
        tc.report_epoch(metrics, model.state_dict(), optimizer.state_dict(), epoch, rank)
        last_metrics = metrics
        if logger is not None:
            logger.log(epoch, metrics)
    tc.dump_state(cfg.run.dump_params_dir, model.state_dict(), rank, train)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    cfg = OmegaConf.create(config["cfg"])
    if cfg.trainer.framework == "tf":
        from trainers.horovod_tf import tf_loop

        tf_loop(config, cfg)
    else:
        torch_loop(config, cfg)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    """`DataParallelTrainer` with Horovod's rendezvous as its backend; one CPU per worker thread, restarts from
    checkpoints up to `fault.max_failures` (each restart redoes the rendezvous)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from trainers.shard_data import shard_config

    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    if cfg.trainer.framework == "tf":
        from trainers.tf_mwms import LEGACY_KERAS_ENV

        env.update(LEGACY_KERAS_ENV)  # tf-keras must own tf.keras from process start (see tf_mwms)
    return DataParallelTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "tracking_uri": tracking_uri, "model_inputs": model_inputs},
        backend_config=HorovodConfig(),
        scaling_config=ScalingConfig(num_workers=cfg.trainer.num_workers, use_gpu=False,
                                     resources_per_worker={"CPU": cfg.trainer.threads_per_worker},
                                     placement_strategy=cfg.trainer.placement_strategy),
        run_config=RunConfig(name=f"run-{run_id}", storage_path=cfg.run.storage_path,
                             failure_config=FailureConfig(max_failures=cfg.fault.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             callbacks=list(callbacks or []),  # e.g. Tune's TuneReportCallback in a sweep
                             worker_runtime_env={"env_vars": env}),
        datasets=datasets,
        # The TF path always caches its shard (ShardArrays).
        dataset_config=shard_config(cfg.trainer.num_workers, cfg.data.cache_in_worker or cfg.trainer.framework == "tf"),
    )


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> None:
    """The final checkpoint's model, in the flavour of its framework (same as ddp / tf_mwms log)."""
    if cfg.trainer.framework == "tf":
        from trainers import tf_mwms

        tf_mwms.log_final_model(uri, run_id, cfg, checkpoint, model_inputs)
    else:
        from trainers import torch_ddp

        torch_ddp.log_final_model(uri, run_id, cfg, checkpoint, model_inputs)
