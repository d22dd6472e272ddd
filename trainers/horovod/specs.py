"""Horovod, registered by name exactly as a user's backend is (contract/registry.py): its config keys, its checks,
its layout, and its `Backend` objects by "module:attribute", one per framework binding (`trainer.framework`).
Framework-free: checking a config imports neither torch, TensorFlow nor Horovod."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.checks import ConfigError, choice, installed
from contract.config import TrainerConfig
from contract.data import DataSchema
from contract.registry import BackendSpec, Layout, ModelSpec, register_backend

FRAMEWORKS = ("torch", "tf")
COMPRESSIONS = ("none", "fp16")


@dataclass
class HorovodConfig(TrainerConfig):
    backend: str = "horovod"            # Horovod over Gloo
    framework: str = "torch"            # torch (hvd.DistributedOptimizer) | tf (DistributedGradientTape)
    compression: str = "none"           # gradient compression on the wire: none | fp16
    tf_steps_per_execution: int = 8     # framework=tf: optimizer steps per compiled call


def horovod_layout(trainer: Any) -> Layout:
    """One replica per worker; the TensorFlow binding trains full batches, as every TensorFlow backend."""
    full = ", and TensorFlow trains full batches only" if trainer.framework == "tf" else ""
    return Layout(dp=trainer.num_workers, full_batches=full)


def check_horovod(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """Horovod's options, and that it is installed (it is built from source, not part of requirements.lock)."""
    trainer = cfg.trainer
    choice("trainer", "framework", trainer.framework, FRAMEWORKS)
    choice("trainer", "compression", trainer.compression, COMPRESSIONS)
    if trainer.use_gpu:
        raise ConfigError("trainer.use_gpu: our horovod build has Gloo CPU operations only (no NCCL)")
    if trainer.min_workers and trainer.framework == "tf":
        raise ConfigError("trainer.min_workers: an elastic horovod run takes trainer.framework=torch; the TensorFlow "
                          "binding keeps the number of workers it starts with, as every TensorFlow backend")
    if not installed("horovod"):
        raise ConfigError("trainer.backend: horovod is not installed; build it with "
                          "`bash cluster/local/build-horovod.sh`")


register_backend(BackendSpec(
    "horovod", {"torch": "trainers.horovod.torch:HorovodTorch", "tf": "trainers.horovod.tf:HorovodTF"}, HorovodConfig,
    FRAMEWORKS, "Horovod over Gloo, PyTorch or TensorFlow binding (`trainer.framework`)",
    check=check_horovod, layout=horovod_layout, elastic=True))
