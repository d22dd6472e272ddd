"""Backends, registered by name. A backend's module exposes
    build_trainer(cfg, datasets, run_id, tracking_uri, model_inputs, callbacks=None) -> a Ray Train trainer
        (`callbacks`: extra Ray Train callbacks for its RunConfig, e.g. a sweep trial's TrialReporter)
    log_final_model(tracking_uri, run_id, cfg, checkpoint, model_inputs) -> None (MLflow flavour of the backend)
    train_loop_per_worker(config) -> None (what every worker runs: `run_worker(cfg, ctx, data)`, its adapter on
        the shared loop, trainers/loop.py)

Modules are imported on demand so that config validation never imports torch, TensorFlow or Ray.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str          # the backend's module (imported by the driver when it builds the trainer)
    frameworks: tuple[str, ...]  # the frameworks it can train with (`trainer.framework` picks when several)
    description: str     # one line for `rtp list`


# framework -> (modules it needs, the package extra that installs them)
FRAMEWORKS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "torch"),
    "tf": (("tensorflow", "tf_keras"), "tf"),
}

BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("ddp", "trainers.torch.ddp", ("torch",), "PyTorch DistributedDataParallel (gloo on CPU, NCCL on GPU)"),
    BackendSpec("fsdp", "trainers.torch.fsdp", ("torch",),
                "PyTorch FSDP2 sharded data parallelism; HSDP, FSDP x TP and pipeline stages (PP x TP x FSDP)"),
    BackendSpec("tp", "trainers.torch.tp", ("torch",),
                "tensor parallelism (Megatron-style layers or DTensor plans) x data parallelism"),
    BackendSpec("tf_mwms", "trainers.tf.mwms", ("tf",),
                "TensorFlow MultiWorkerMirroredStrategy: tf-keras fit or a custom loop"),
    BackendSpec("tf_dtensor", "trainers.tf.dtensor.trainer", ("tf",),
                "TensorFlow DTensor: data, model or 2D parallelism on a batch x model mesh"),
    BackendSpec("tf_ps", "trainers.tf.ps.trainer", ("tf",),
                "TensorFlow ParameterServerStrategy: asynchronous data parallelism"),
    BackendSpec("horovod", "trainers.horovod.trainer", ("torch", "tf"),
                "Horovod over Gloo, PyTorch or TensorFlow binding (`trainer.framework`)"),
)}


def get_backend(name: str) -> ModuleType:
    return importlib.import_module(BACKENDS[name].module)
