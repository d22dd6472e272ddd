"""Backends: one module each, exposing
    build_trainer(cfg, datasets, run_id, tracking_uri, model_inputs, callbacks=None) -> a Ray Train trainer
        (`callbacks`: extra Ray Train callbacks for its RunConfig, e.g. a sweep trial's TrialReporter)
    log_final_model(tracking_uri, run_id, cfg, checkpoint, model_inputs) -> None (MLflow flavour of the backend)
    train_loop_per_worker(config) -> None (what every worker runs: its adapter on the shared loop, trainers/loop.py)

Modules are imported on demand so that config validation never imports torch, TensorFlow or Ray.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS: dict[str, str] = {
    "ddp": "trainers.torch_ddp",
    "tp": "trainers.torch_tp",
    "fsdp": "trainers.torch_fsdp",
    "tf_mwms": "trainers.tf_mwms",
    "horovod": "trainers.horovod",
    "tf_dtensor": "trainers.tf_dtensor",
    "tf_ps": "trainers.tf_ps",
}


def get_backend(name: str) -> ModuleType:
    return importlib.import_module(BACKENDS[name])
