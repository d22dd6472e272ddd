"""Horovod (Gloo, CPU) on Ray Train V2: `DataParallelTrainer` + `HorovodConfig` (trainers/horovod_backend.py).

`trainer.framework` picks the binding: `torch` (`hvd.DistributedOptimizer`, any of our PyTorch models, MNIST or
IMDb; trainers/horovod_torch.py) or `tf` (a custom loop on `hvd.DistributedGradientTape`, tf-keras models;
trainers/horovod_tf.py). Both are adapters on the shared loop (trainers/loop.py): same data (Ray Data shards),
metric names, checkpoints and MLflow contract as the other backends. This module imports neither framework, so
a TF worker never imports torch.

Options: `trainer.compression` (none | fp16: gradients travel as float16); the recipe's `trainer.grad_accum` (k:
gradients of k batches are accumulated locally and all-reduced once, one optimizer step per k batches) is
Horovod's `backward_passes_per_step`.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trainers.horovod_backend import HorovodConfig

BUILD_HINT = "horovod is not installed in this environment; build it with `bash cluster/local/build-horovod.sh`"
FRAMEWORK_MODULES = {"torch": "trainers.horovod_torch", "tf": "trainers.horovod_tf"}


def import_horovod(framework: str) -> Any:
    """`horovod.torch` or `horovod.tensorflow`, with the build hint instead of a bare ModuleNotFoundError."""
    try:
        return importlib.import_module({"torch": "horovod.torch", "tf": "horovod.tensorflow"}[framework])
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("horovod"):
            raise ModuleNotFoundError(BUILD_HINT) from err
        raise


def init_horovod(hvd: Any, rank: int, size: int) -> None:
    """`hvd.init()` (Gloo rendezvous with the server the backend started, or a lone process without one); checks
    Horovod agrees with Ray on who is who, since checkpoints and MLflow logging are done by Ray's rank 0."""
    hvd.init()
    if (hvd.rank(), hvd.size()) != (rank, size):
        raise RuntimeError(f"horovod rank/size {hvd.rank()}/{hvd.size()} != Ray Train's {rank}/{size}")


def record_init(directory: str | None, rank: int) -> None:
    """`run.dump_params_dir` debugging aid: one line per `hvd.init()` (rank, pid, rendezvous address), so a test
    can see that a restarted worker group did its own rendezvous."""
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    line = (f"rank={rank} pid={os.getpid()} rendezvous={os.environ.get('HOROVOD_GLOO_RENDEZVOUS_ADDR')}:"
            f"{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT')} iface={os.environ.get('HOROVOD_GLOO_IFACE')}\n")
    with open(Path(directory) / "horovod_init.log", "a") as log:
        log.write(line)


def framework_module(cfg: DictConfig) -> Any:
    return importlib.import_module(FRAMEWORK_MODULES[cfg.trainer.framework])


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from trainers.worker import ray_context, worker_config

    cfg = worker_config(config)
    framework_module(cfg).run_worker(cfg, ray_context(config, cfg), config["model_inputs"])


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    """`DataParallelTrainer` with Horovod's rendezvous as its backend (each restart redoes the rendezvous)."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from trainers.shard_data import shard_config
    from trainers.worker import loop_config, run_config, scaling_config

    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    if cfg.trainer.framework == "tf":
        from trainers.tf_common import LEGACY_KERAS_ENV

        env.update(LEGACY_KERAS_ENV)  # tf-keras must own tf.keras from process start (trainers/tf_common.py)
    return DataParallelTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(cfg, run_id, tracking_uri, model_inputs),
        backend_config=HorovodConfig(),
        scaling_config=scaling_config(cfg, use_gpu=False),
        run_config=run_config(cfg, run_id, callbacks, env),
        datasets=datasets,
        # The TF path always caches its shard (ShardArrays).
        dataset_config=shard_config(cfg.trainer.num_workers, cfg.data.cache_in_worker or cfg.trainer.framework == "tf"),
    )


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> None:
    """The final checkpoint's model, in the flavour of its framework (same as ddp / tf_mwms log)."""
    backend = "trainers.torch_ddp" if cfg.trainer.framework == "torch" else "trainers.tf_mwms"
    importlib.import_module(backend).log_final_model(uri, run_id, cfg, checkpoint, model_inputs)
