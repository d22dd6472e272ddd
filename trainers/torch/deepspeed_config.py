"""The DeepSpeed config of a trainer=deepspeed run, framework-free (the driver checks it before any worker starts):
the recipe keys mapped into DeepSpeed's JSON, merged over a user's own DeepSpeed JSON (`trainer.deepspeed_config`).
A key of the user's file that the recipe also sets must say the same, else `DeepSpeedConfigError` names both; the
optimizer and the schedule are the recipe's (`trainer.optimizer`, `trainer.lr_schedule`), so a file's `optimizer`
and `scheduler` sections (and `torch_autocast`, `bf16` and `fp16`: `trainer.precision`) are refused rather than
silently overridden."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# `trainer.precision` -> DeepSpeed's torch.autocast section (fp32 weights, autocast forward: the recipe's precision)
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}
OWN_SECTIONS = {"optimizer": "trainer.optimizer, trainer.lr, trainer.lr_schedule",  # what the recipe owns outright
                "scheduler": "trainer.optimizer, trainer.lr, trainer.lr_schedule",
                "torch_autocast": "trainer.precision"}


class DeepSpeedConfigError(ValueError):
    """One line naming the `trainer.*` key and what disagrees."""


def recipe_config(trainer: Any) -> dict[str, Any]:
    """The DeepSpeed keys the recipe sets: the batch per rank, accumulation, clipping, precision, ZeRO stage."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": trainer.batch_size,
        "gradient_accumulation_steps": trainer.grad_accum,
        "gradient_clipping": float(trainer.grad_clip or 0.0),
        "zero_optimization": {"stage": trainer.zero_stage},
    }
    if trainer.precision in AUTOCAST:
        config["torch_autocast"] = {"enabled": True, "dtype": AUTOCAST[trainer.precision]}
    return config


def user_config(trainer: Any) -> dict[str, Any]:
    """`trainer.deepspeed_config`'s JSON object ({} when not set)."""
    if not trainer.deepspeed_config:
        return {}
    path = Path(trainer.deepspeed_config)
    try:
        loaded = json.loads(path.read_text())
    except OSError as err:
        raise DeepSpeedConfigError(f"trainer.deepspeed_config: cannot read '{path}' ({err.strerror})") from err
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"trainer.deepspeed_config: '{path}' is not JSON ({err.msg}, line {err.lineno})") \
            from err
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"trainer.deepspeed_config: '{path}' must hold a JSON object")
    return loaded


def engine_config(trainer: Any) -> dict[str, Any]:
    """The user's DeepSpeed JSON (if any) with the recipe's keys over it; `DeepSpeedConfigError` on a conflict."""
    user = user_config(trainer)
    for section, keys in OWN_SECTIONS.items():
        if section in user:
            raise DeepSpeedConfigError(f"trainer.deepspeed_config: its '{section}' section is the recipe's here "
                                       f"({keys}); remove it")
    for section in ("bf16", "fp16"):
        if isinstance(user.get(section), dict) and user[section].get("enabled"):
            raise DeepSpeedConfigError(f"trainer.deepspeed_config: '{section}.enabled' is trainer.precision here "
                                       f"(trainer.precision={section}); remove it")
    global_batch = trainer.batch_size * trainer.grad_accum * trainer.num_workers
    if "train_batch_size" in user:
        _agree("train_batch_size", user["train_batch_size"], global_batch)
    merged = dict(user)
    for key, value in recipe_config(trainer).items():
        theirs = user.get(key)
        if isinstance(value, dict) and isinstance(theirs, dict):
            for inner, wanted in value.items():
                _agree(f"{key}.{inner}", theirs.get(inner, wanted), wanted)
            merged[key] = {**theirs, **value}
        else:
            if theirs is not None:
                _agree(key, theirs, value)
            merged[key] = value
    merged.setdefault("zero_allow_untested_optimizer", True)  # the recipe's torch optimizers (ZeRO supports them)
    merged.setdefault("steps_per_print", 2**31 - 1)  # the loop reports; DeepSpeed's own step lines stay off
    return merged


RECIPE_KEYS = {"train_batch_size": "trainer.batch_size x grad_accum x num_workers",
               "train_micro_batch_size_per_gpu": "trainer.batch_size",
               "gradient_accumulation_steps": "trainer.grad_accum", "gradient_clipping": "trainer.grad_clip",
               "zero_optimization.stage": "trainer.zero_stage", "torch_autocast.enabled": "trainer.precision",
               "torch_autocast.dtype": "trainer.precision"}


def _agree(key: str, theirs: Any, ours: Any) -> None:
    if theirs != ours:
        raise DeepSpeedConfigError(f"trainer.deepspeed_config: {key}={json.dumps(theirs)} disagrees with "
                                   f"{RECIPE_KEYS.get(key, key)} ({key}={json.dumps(ours)} here); set one of them")
