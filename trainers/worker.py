"""Ray Train glue shared by every backend, framework-free: the config a worker receives, its `WorkerContext`,
and the Ray Train run and scaling settings every trainer is built with."""
from __future__ import annotations

import importlib
import math
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf

from contract.checkpoint import checkpoint_origin
from contract.config import at_world_size, monitor_of, typed_config
from contract.console import quiet_ray_logs
from contract.data import DataSchema
from contract.hang import NoProgress, Progress
from contract.metrics import eval_metric
from contract.progress import StepBar, progress_wanted
from contract.registry import plugin_roots
from contract.resume import stop_file
from contract.startup import StartupMarks, started_at
from trainers.callbacks.base import LoopCallback
from trainers.callbacks.divergence import DivergenceFile
from trainers.callbacks.faults import FaultInjection
from trainers.callbacks.hang_marks import HangMarks
from trainers.callbacks.mfu import Utilisation
from trainers.callbacks.profiling import Profiling
from trainers.callbacks.startup import StartupMetrics
from trainers.callbacks.step_bar import StepBars
from trainers.callbacks.step_times import StepTimes
from trainers.callbacks.world_sizes import WorldSizes
from trainers.hang_watch import HangWatch
from trainers.context import MetricsSink, NoMetrics, WorkerContext
from trainers.model_flops import run_flops_per_sample


ELASTIC_PLACEMENT_S = 10.0  # an elastic run's wait for one placement of its workers before it sizes the group again


def loop_config(cfg: DictConfig, run_id: str, tracking_uri: str, inputs: DataSchema) -> dict[str, Any]:
    """`train_loop_config` of every trainer: plain data, so Ray can ship it to the workers: the config, the data's
    schema, and where the driver found the run's plugins. Whether to draw progress is decided here, in the driver:
    its output is the one someone may watch. The trainer is built right after: the start-up's driver part ends now
    (contract/startup.py)."""
    now = time.time()
    return {"cfg": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id, "tracking_uri": tracking_uri,
            "inputs": inputs.to_dict(), "plugin_roots": plugin_roots(cfg.plugins),
            "progress": progress_wanted(cfg.run.progress), "startup": {"asked": started_at(), "trainer_built": now},
            "flops_per_sample": run_flops_per_sample(cfg, inputs)}


def worker_config(config: dict[str, Any]) -> DictConfig:
    """The validated config as the driver resolved it: typed by the backend's and model's schemas, read-only, the
    run's plugins imported (`typed_config`); an elastic run's at the size of this worker group (`at_world_size`)."""
    cfg = typed_config(config["cfg"], config.get("plugin_roots", []))
    if not cfg.trainer.min_workers:
        return cfg
    import ray.train

    return at_world_size(cfg, ray.train.get_context().get_world_size())


def worker_inputs(config: dict[str, Any]) -> DataSchema:
    """The data's features and target, as the driver read them from the manifest."""
    return DataSchema.from_dict(config["inputs"])


def ray_context(config: dict[str, Any], cfg: DictConfig, device: Any = None, peak_flops: float | None = None,
                on_hang: Iterable[Callable[[Path, int], None]] = (), every_rank_trains: bool = True) -> WorkerContext:
    """This Ray Train worker's context: rank, report, checkpoint to restore, rank 0's MLflow logger, STOP file, the
    `device` it computes on (`peak_flops`: its peak, if known, for MFU), and the loop's callbacks (`ray_callbacks`).
    `every_rank_trains`: each rank runs the loop, so each is watched for hangs (`on_hang`: what it adds to its
    stacks then) and the last one takes the injected faults; else (tf_ps) the rank that trains sets those up. Tags
    `rank<r>.node` with the IP of the Ray node the worker landed on; rank 0 starts its system metrics."""
    worker_began = time.time()
    import ray.train
    import ray.util

    if not cfg.run.verbose:
        quiet_ray_logs()

    from contract.tracking import (EpochLogger, SystemMetrics, TrackingSpool, lineage_start_ms, ray_run_name, run_dir,
                                   spool_dir)

    run_folder = run_dir(cfg.run.storage_path, config["run_id"])  # on shared storage
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    # Every MLflow write of a worker goes through its spool: a tracking server that blinks loses nothing.
    spool = TrackingSpool(config["tracking_uri"], config["run_id"], spool_dir(cfg.run.storage_path, config["run_id"]),
                          f"rank{rank}")
    spool.write({"op": "tag", "key": f"rank{rank}.node", "value": ray.util.get_node_ip_address()})
    if rank == 0 and config.get("flops_per_sample"):
        spool.write({"op": "tag", "key": "model.flops_per_sample", "value": f"{config['flops_per_sample']:.6g}"})
    if rank == 0 and cfg.run.system_metrics:  # its thread lives as long as this worker process
        SystemMetrics(config["tracking_uri"], config["run_id"], "rank0", cfg.run.system_metrics_interval_s)
    logger: MetricsSink = NoMetrics()
    if rank == 0:
        # A run continuing another checkpoint is a new line of training: its epochs are logged afresh.
        since = lineage_start_ms(Path(cfg.run.storage_path) / ray_run_name(config["run_id"], cfg.run.resume_from)) \
            if cfg.run.resume_from else 0
        logger = EpochLogger(spool, run_folder / "tensorboard" if cfg.run.tensorboard else None, since)
    restored = restored_checkpoint(cfg)
    # The start-up of the run's first attempt (a restart's is Ray Train's recovery, not the run's start)
    startup = StartupMarks(**config["startup"], worker_began=worker_began) \
        if rank == 0 and restored is None and "startup" in config else None
    callbacks: list[LoopCallback] = []
    if every_rank_trains:
        progress = watch_for_hangs(cfg.fault, run_folder, rank, world_size)
        progress.on_hang.extend(on_hang)
        callbacks += [HangMarks(progress), FaultInjection(cfg.fault, rank, world_size)]
    callbacks += ray_callbacks(cfg, run_folder, rank, config, startup, peak_flops)
    return WorkerContext(
        rank=rank, world_size=world_size, report=ray_report, epochs=cfg.trainer.epochs, restored=restored,
        logger=logger, stop_file=stop_file(cfg.run.resume_dir), log_every_n_steps=cfg.trainer.log_every_n_steps,
        checkpoint_every_n_steps=cfg.run.checkpoint_every_n_steps, checkpoint_every_s=cfg.run.checkpoint_every_s,
        nan_patience=cfg.run.nan_patience, origin=checkpoint_origin(cfg.trainer.backend, cfg.model.name, world_size),
        monitor=monitor_of(cfg.run), evaluated=eval_metric(worker_inputs(config).target.task), device=device,
        callbacks=callbacks)


def ray_callbacks(cfg: DictConfig, run_folder: Path, rank: int, config: dict[str, Any], startup: StartupMarks | None,
                  peak_flops: float | None) -> list[LoopCallback]:
    """The loop's side concerns in a run: every rank's step times (and the straggler check), FLOPs and MFU; on
    rank 0 the divergence file, the step bar (when the driver wants progress), the profiler
    (`trainer.profile_steps`) and, on the run's first attempt, the start-up metrics."""
    callbacks: list[LoopCallback] = [StepTimes(cfg.run.straggler_ratio)]
    if cfg.trainer.min_workers:
        callbacks.append(WorldSizes())
    if config.get("flops_per_sample"):
        callbacks.append(Utilisation(config["flops_per_sample"], peak_flops))
    if rank != 0:
        return callbacks
    callbacks.append(DivergenceFile(run_folder))
    if config.get("progress"):
        callbacks.append(StepBars(ray_step_bar))
    if cfg.trainer.profile_steps:
        callbacks.append(Profiling(run_folder / "profile", cfg.trainer.profile_steps))
    if startup is not None:
        callbacks.append(StartupMetrics(startup))
    return callbacks


def watch_for_hangs(fault: DictConfig, run_folder: Path, rank: int, world_size: int) -> Progress:
    """This rank's position, watched by its hang watcher (trainers/hang_watch.py) unless `fault.hang_timeout_s`
    is 0. The ranks agree on an attempt id (Ray Train's barrier, once per attempt), so a restarted attempt's
    watchers skip the positions its predecessor left in the run's folder."""
    if fault.hang_timeout_s <= 0:
        return NoProgress()
    attempt = uuid.uuid4().hex[:12]
    if world_size > 1:
        import ray.train.collective

        attempt = ray.train.collective.broadcast_from_rank_zero(attempt)
    progress = Progress()
    HangWatch(progress, run_folder, rank, world_size, fault.hang_timeout_s, attempt).start()
    return progress


def restored_checkpoint(cfg: DictConfig) -> Any:
    """What this worker resumes from: the Ray Train run's own latest checkpoint (after a worker failure), else
    `run.resume_from`, else nothing."""
    import ray.train

    own = ray.train.get_checkpoint()
    if own is not None or not cfg.run.resume_from:
        return own
    return ray.train.Checkpoint.from_directory(cfg.run.resume_from)


def dataset_shards(*names: str) -> tuple[list[Any], float]:
    """This worker's Ray Data shards of the datasets `names`, and the seconds it waited for them: the first call
    waits while Ray Train splits the datasets (`data_split.OrderedSplit`; cached data the driver has
    read by then, `pipelines/data/readers.Materializing`), which is part of pulling the data."""
    import ray.train

    start = time.perf_counter()
    shards = [ray.train.get_dataset_shard(name) for name in names]
    return shards, time.perf_counter() - start


def ray_step_bar(description: str, total: int, done: int) -> StepBar:
    """A bar over an epoch's steps, `done` of them already trained (a resumed epoch), drawn by the driver: Ray's
    distributed tqdm prints its state to this worker's log (at most once a second, and on close), and the
    driver's log reader renders it."""
    from ray.experimental import tqdm_ray

    bar = tqdm_ray.tqdm(desc=description, total=total, unit="step")
    if done:
        bar.update(done)
    return bar


def ray_report(metrics: dict[str, float], directory: str | None, background: bool = False,
               written: Callable[[], Any] | None = None) -> None:
    """Ray Train's report of `metrics` and this rank's checkpoint folder, if any: copied to storage before it
    returns, or (`background`) by a thread of Ray Train's while training goes on, which then removes the folder.
    `written`: the copy waits for it first (the adapter still writes the folder)."""
    import ray.train
    from ray.train import CheckpointUploadMode

    checkpoint = ray.train.Checkpoint.from_directory(directory) if directory else None
    mode = CheckpointUploadMode.ASYNC if background else CheckpointUploadMode.SYNC
    upload = None
    if checkpoint is not None and written is not None:
        storage = ray.train.get_context().get_storage()

        def upload(local: Any, name: str) -> Any:
            written()
            return storage.persist_current_checkpoint(local, name)  # Ray Train's own copy to storage
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=mode, checkpoint_upload_fn=upload)


def scaling_config(cfg: DictConfig, resources: dict[str, float] | None = None, use_gpu: bool | None = None) -> Any:
    """One CPU per worker thread (plus `resources`), placed by `trainer.placement_strategy`; an elastic run's
    group between `trainer.min_workers` and `num_workers` workers, resized by Ray Train as nodes go and come."""
    from ray.train import ScalingConfig

    trainer = cfg.trainer
    workers = (trainer.min_workers, trainer.num_workers) if trainer.min_workers else trainer.num_workers
    return ScalingConfig(num_workers=workers, use_gpu=trainer.use_gpu if use_gpu is None else use_gpu,
                         resources_per_worker=resources or {"CPU": trainer.threads_per_worker},
                         placement_strategy=trainer.placement_strategy,
                         elastic_resize_monitor_interval_s=trainer.resize_check_s)


def placement_patience(cfg: DictConfig) -> tuple[float | None, int]:
    """(How long Ray Train waits to place a worker group, how many times it may give up and try again), None: its
    default. Giving up is a controller failure. A fixed-size run waits `fault.resource_timeout_s` once, or forever
    (0). An elastic run waits ELASTIC_PLACEMENT_S at a time, up to `fault.resource_timeout_s` in all: a group
    sized from a stale view of the cluster (a node lost moments ago, not yet known dead) cannot be placed, and
    the next try sizes it again."""
    timeout = cfg.fault.resource_timeout_s
    if not cfg.trainer.min_workers:
        return (timeout, 0) if timeout > 0 else (None, -1)
    if timeout <= 0:
        return ELASTIC_PLACEMENT_S, -1
    wait = min(ELASTIC_PLACEMENT_S, timeout)
    return wait, math.ceil(timeout / wait) - 1


def run_config(cfg: DictConfig, run_id: str, callbacks: list | None, env: dict[str, str] | None = None) -> Any:
    """A Ray Train run named after the MLflow run (so a rerun finds its checkpoints), restarts from checkpoints up
    to `fault.max_failures`. `callbacks`: e.g. a sweep trial's TrialReporter; `env`: variables the worker
    processes must have from their start (tf-keras)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig

    from contract.tracking import ray_run_name
    from trainers.keep_best import KeepBest

    _, controller_retries = placement_patience(cfg)
    # Ray Train keeps the last `run.keep_checkpoints` checkpoints (the latest to resume from), KeepBest the best
    # epoch's for `run.final_model=best`.
    checkpoints = CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints)
    callbacks = [KeepBest(), *(callbacks or [])]
    return RunConfig(name=ray_run_name(run_id, cfg.run.resume_from), storage_path=cfg.run.storage_path,
                     failure_config=FailureConfig(max_failures=cfg.fault.max_failures,
                                                  controller_failure_limit=controller_retries),
                     checkpoint_config=checkpoints, callbacks=callbacks,
                     logging_config=LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING"),
                     worker_runtime_env={"env_vars": env} if env else None)


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker runs (reported by the worker itself)."""

    node_id: str
    node_ip: str
    pid: int


def worker_place() -> WorkerPlace:
    """Runs on a worker: its Ray node and process."""
    import ray

    context = ray.get_runtime_context()
    return WorkerPlace(context.get_node_id(), ray.util.get_node_ip_address(), os.getpid())


def free_addresses(worker_group: Any) -> list[str]:
    """In a backend's `on_start`: for each worker, `ip:port` of a port free on its Ray node now, for a server the
    worker starts moments later (DTensor clients, tf_ps servers); no two alike (each worker draws its own)."""
    for _ in range(5):
        addresses = worker_group.execute(free_address)
        if len(set(addresses)) == len(addresses):
            return addresses
    raise RuntimeError(f"no distinct free ports for the workers' servers, drew {addresses}")


def free_address() -> str:
    """Runs on a worker: `ip:port` of a port free on its Ray node now, above the kernel's range of ports for
    outgoing connections when that leaves room (Linux: 61000-65535): any outgoing connection may take a port of
    that range before the server binds it (a tf_ps server restarted on a taken port: 'Could not start gRPC server')."""
    import ray.util

    ip = ray.util.get_node_ip_address()
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[1]) + 1
    except (OSError, ValueError, IndexError):
        low = 65536
    candidates = [random.randint(low, 65535) for _ in range(50)] if low <= 65535 - 100 else []
    for port in [*candidates, 0]:  # 0: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, port))
            except OSError:
                continue
            return f"{ip}:{probe.getsockname()[1]}"
    raise RuntimeError(f"no free port on {ip}")


def set_worker_envs(worker_group: Any, envs: list[dict[str, str]]) -> None:
    """In a backend's `on_start`: variables each worker's training function reads, `envs[rank]` for each rank."""
    import ray

    ray.get([worker_group.execute_single_async(rank, set_env, env) for rank, env in enumerate(envs)])


def set_env(env: dict[str, str]) -> None:
    """Runs on a worker: see `set_worker_envs`."""
    os.environ.update(env)


def on_worker(module: str, name: str, **kwargs: Any) -> Any:
    """Runs on a worker: `<module>.<name>(**kwargs)`, importing the module (and its framework) there."""
    return getattr(importlib.import_module(module), name)(**kwargs)
