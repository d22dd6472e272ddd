"""Backends, registered by name (contract/registry.py), the built-in ones as a user's would be. A backend's module
exposes
    build_trainer(cfg, datasets, run_id, tracking_uri, inputs, callbacks=None) -> a Ray Train trainer
        (`inputs`: the data's `contract.data.DataSchema`; `callbacks`: extra Ray Train callbacks for its RunConfig,
        e.g. a sweep trial's TrialReporter)
    log_final_model(tracking_uri, run_id, cfg, checkpoint, inputs) -> None (MLflow flavour of the backend)
    train_loop_per_worker(config) -> None (what every worker runs: `run_worker(cfg, ctx, data)`, its adapter on
        the shared loop, trainers/loop.py)

Modules are imported on demand so that config validation never imports torch, TensorFlow or Ray. Importing this
package registers the built-in models too (trainers/models/__init__.py).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import trainers.models  # noqa: F401  (registers the built-in models)
from contract.config import (DDPConfig, DeepSpeedConfig, FSDPConfig, HorovodConfig, LightningConfig, TFDTensorConfig,
                             TFMWMSConfig, TFPSConfig, TPConfig)
from contract.registry import BACKENDS, BackendSpec, register_backend

# framework -> (modules it needs, the package extra that installs them)
FRAMEWORKS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "torch"),
    "tf": (("tensorflow", "tf_keras"), "tf"),
}

for _spec in (
    BackendSpec("ddp", "trainers.torch.ddp", DDPConfig, ("torch",),
                "PyTorch DistributedDataParallel (gloo on CPU, NCCL on GPU)"),
    BackendSpec("fsdp", "trainers.torch.fsdp", FSDPConfig, ("torch",),
                "PyTorch FSDP2 sharded data parallelism; HSDP, FSDP x TP and pipeline stages (PP x TP x FSDP)"),
    BackendSpec("tp", "trainers.torch.tp", TPConfig, ("torch",),
                "tensor parallelism (Megatron-style layers or DTensor plans) x data parallelism"),
    BackendSpec("lightning", "trainers.torch.lightning", LightningConfig, ("torch",),
                "PyTorch Lightning's Trainer (ddp, or fsdp on GPUs) through Ray Train's Lightning integration",
                model_builders=("lightning", "torch"), needs=("lightning",), extra="lightning"),
    BackendSpec("deepspeed", "trainers.torch.deepspeed", DeepSpeedConfig, ("torch",),
                "DeepSpeed's engine: ZeRO stage 1, 2 or 3 (gloo on CPU, NCCL on GPU)", needs=("deepspeed",),
                extra="deepspeed"),
    BackendSpec("tf_mwms", "trainers.tf.tf_mwms", TFMWMSConfig, ("tf",),
                "TensorFlow MultiWorkerMirroredStrategy: tf-keras fit or a custom loop"),
    BackendSpec("tf_dtensor", "trainers.tf.tf_dtensor", TFDTensorConfig, ("tf",),
                "TensorFlow DTensor: data, model or 2D parallelism on a batch x model mesh",
                model_builders=("dtensor",)),
    BackendSpec("tf_ps", "trainers.tf.tf_ps", TFPSConfig, ("tf",),
                "TensorFlow ParameterServerStrategy: asynchronous data parallelism"),
    BackendSpec("horovod", "trainers.horovod.trainer", HorovodConfig, ("torch", "tf"),
                "Horovod over Gloo, PyTorch or TensorFlow binding (`trainer.framework`)"),
):
    register_backend(_spec)


def get_backend(name: str) -> ModuleType:
    return importlib.import_module(BACKENDS.get(name).module)


def framework_of(trainer: Any) -> str:
    """The framework a run of this trainer config trains with (`trainer.framework` where the backend has several)."""
    spec = BACKENDS.get(trainer.backend)
    return trainer.framework if len(spec.frameworks) > 1 else spec.frameworks[0]


def model_builders(trainer: Any) -> tuple[str, ...]:
    """The builders of a model spec this trainer config can build its model with (torch, keras, dtensor,
    lightning), the first one a spec has being the one used."""
    spec = BACKENDS.get(trainer.backend)
    return spec.model_builders or ({"torch": "torch", "tf": "keras"}[framework_of(trainer)],)
