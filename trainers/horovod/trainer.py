"""Horovod (Gloo, CPU) on Ray Train V2: `DataParallelTrainer` + `RendezvousConfig` (trainers/horovod/rendezvous.py).

`trainer.framework` picks the binding: `torch` (`hvd.DistributedOptimizer`, any of our PyTorch models, MNIST or
IMDb; trainers/horovod/torch.py) or `tf` (a custom loop on `hvd.DistributedGradientTape`, tf-keras models;
trainers/horovod/tf.py). Both are adapters on the shared loop (trainers/loop.py): same data (Ray Data shards),
metric names, checkpoints and MLflow contract as the other backends. This module imports neither framework, so
a TF worker never imports torch.

Options: `trainer.compression` (none | fp16: gradients travel as float16); the recipe's `trainer.grad_accum` (k:
gradients of k batches are accumulated locally and all-reduced once, one optimizer step per k batches) is
Horovod's `backward_passes_per_step`.
"""
from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig

from contract.data import DataSchema
from trainers.horovod.rendezvous import RendezvousConfig

FRAMEWORK_MODULES = {"torch": "trainers.horovod.torch", "tf": "trainers.horovod.tf"}


def framework_module(cfg: DictConfig) -> Any:
    return importlib.import_module(FRAMEWORK_MODULES[cfg.trainer.framework])


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from trainers.worker import worker_config

    framework_module(worker_config(config)).train_loop_per_worker(config)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, inputs: DataSchema,
                  callbacks: list | None = None):
    """`DataParallelTrainer` with Horovod's rendezvous as its backend (each restart redoes the rendezvous)."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from trainers.preflight import preflight_config
    from trainers.data_split import shard_config
    from trainers.worker import loop_config, run_config, scaling_config

    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    if cfg.trainer.framework == "tf":
        from trainers.tf.common import LEGACY_KERAS_ENV

        env.update(LEGACY_KERAS_ENV)  # tf-keras must own tf.keras from process start (trainers/tf/common.py)
    return DataParallelTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(cfg, run_id, tracking_uri, inputs),
        backend_config=RendezvousConfig(preflight=preflight_config(cfg, run_id)),
        scaling_config=scaling_config(cfg, use_gpu=False),
        run_config=run_config(cfg, run_id, callbacks, env),
        datasets=datasets,
        # The TF path always caches its shard (ShardArrays).
        dataset_config=shard_config(cfg.trainer.num_workers, cfg.data.cache_in_worker or cfg.trainer.framework == "tf"),
    )


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, inputs: DataSchema) -> None:
    """The final checkpoint's model, in the flavour of its framework (same as ddp / tf_mwms log)."""
    shared = "trainers.torch.common" if cfg.trainer.framework == "torch" else "trainers.tf.common"
    importlib.import_module(shared).log_final_model(uri, run_id, cfg, checkpoint, inputs)
