"""A run's training FLOPs per sample (contract/mfu.py says what they are for), framework-free until it counts."""
from __future__ import annotations

from typing import Any

from contract.data import DataSchema
from contract.registry import BACKENDS, MODELS, resolve


def flops_per_sample(model_cfg: Any, inputs: DataSchema) -> float | None:
    """The model spec's own count (`ModelSpec.flops_per_sample`), else one counted on its PyTorch model
    (trainers/torch/flop_counter.py); None for a model with neither (a Keras-only spec), where PyTorch is not installed,
    or where the model does not run on the meta device (an operator without a meta kernel: then give the count)."""
    spec = MODELS.get(model_cfg.name)
    if spec.flops_per_sample is not None:
        return float(resolve(spec.flops_per_sample)(model_cfg, inputs))
    if spec.torch is None:
        return None
    try:
        from trainers.torch.flop_counter import training_flops_per_sample
    except ImportError:  # no PyTorch here
        return None
    from trainers.models import build_model

    try:
        return training_flops_per_sample(lambda: build_model(model_cfg, inputs, seed=0), inputs)
    except Exception:  # the user's model: any operator may lack a meta kernel; the run goes on without MFU
        return None


def run_flops_per_sample(cfg: Any, inputs: DataSchema) -> float | None:
    """A run's: counted only where the backend trains with PyTorch (its driver has PyTorch loaded already), else
    the spec's own figure if it gives one."""
    spec = MODELS.get(cfg.model.name)
    framework = cfg.trainer.get("framework") or BACKENDS.get(cfg.trainer.backend).frameworks[0]
    if framework != "torch" and spec.flops_per_sample is None:
        return None
    return flops_per_sample(cfg.model, inputs)
