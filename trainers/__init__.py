"""Backends: one module each, exposing `build_trainer(cfg, datasets, run_id)` and `train_loop_per_worker(config)`.

Modules are imported on demand so that config validation never imports torch, TensorFlow or Ray.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS: dict[str, str] = {
    "ddp": "trainers.torch_ddp",
    "tp": "trainers.torch_tp",
}


def get_backend(name: str) -> ModuleType:
    return importlib.import_module(BACKENDS[name])
