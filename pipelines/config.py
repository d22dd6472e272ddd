"""Config: Hydra composes `conf/` with a command's overrides, the typed schemas of contract/config.py (one trainer
schema per backend) type it, and pipelines/checks.py validates it, before Ray or MLflow is touched.

Every error is a `ConfigError` whose message starts with the offending key; the commands print it on one line and
exit with code 2.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contract.config import MODEL_SCHEMAS, TRAINER_SCHEMAS, parallel_degrees, schema, worker_resources
from pipelines.checks import check_values
from pipelines.errors import ConfigError, installed

__all__ = ["CONF_DIR", "ConfigError", "check_fits_this_machine", "compose", "flatten", "group_choices", "installed",
           "load_config", "parallel_params", "schema_for"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def schema_for(cfg: DictConfig) -> DictConfig:
    """The typed schema of the backend and model the composed config names: a key of another backend's schema
    is then an unknown key."""
    backend = OmegaConf.select(cfg, "trainer.backend")
    if backend not in TRAINER_SCHEMAS:
        raise ConfigError(f"trainer.backend: unknown backend '{backend}' (choices: {sorted(TRAINER_SCHEMAS)})")
    model_name = OmegaConf.select(cfg, "model.name")
    if model_name not in MODEL_SCHEMAS:
        raise ConfigError(f"model.name: unknown model '{model_name}' (choices: {sorted(MODEL_SCHEMAS)})")
    return schema(backend, model_name)


# Keys that were renamed: an override of the old name is one line naming the new one.
RENAMED = {"trainer.tf_devices": "trainer.devices_per_worker"}


def group_choices(group: str) -> list[str]:
    """The options of a config group (`trainer`, `data`, `model`, `sweep`): its files in conf/<group>/."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def compose(overrides: list[str]) -> DictConfig:
    """`conf/config.yaml` with Hydra-style overrides, not yet typed or checked; ConfigError in one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="config", overrides=overrides)
    except HydraException as err:
        raise ConfigError(_compose_error(str(err).strip().splitlines()[0])) from err


def _compose_error(first_line: str) -> str:
    """Hydra's error as our one line: an unknown key (renamed, or did you mean), an unknown group choice."""
    unknown = re.fullmatch(r"Could not override '([\w.]+)'\.", first_line)
    if unknown and unknown[1] in RENAMED:
        return f"{unknown[1]}: renamed {RENAMED[unknown[1]]}"
    if unknown:
        return (f"{unknown[1]}: not a key of this config{_did_you_mean(unknown[1])} (each backend has its own "
                f"trainer keys: rtp config --help)")
    choice = re.search(r"Could not find '(\w+)/([^']+)'", first_line)
    if choice and (CONF_DIR / choice[1]).is_dir():
        return f"{choice[1]}: unknown choice '{choice[2]}' (choices: {', '.join(group_choices(choice[1]))})"
    return f"overrides: {first_line}"


def _did_you_mean(key: str) -> str:
    """` (did you mean trainer.epochs?)` for a typo of a key of any backend's or model's config, else ''."""
    import difflib

    keys = set()
    for backend in TRAINER_SCHEMAS:
        for model in MODEL_SCHEMAS:
            keys.update(flatten(schema(backend, model)))
    keys.discard(key)  # another backend's key: the message says so already
    close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def _absolutise_paths(cfg: DictConfig) -> None:
    # The job may run from a copy of the repo (ray job --working-dir): pin paths to where they were given.
    cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    cfg.run.storage_path = str(Path(cfg.run.storage_path).expanduser().resolve())
    for key in ("dump_params_dir", "resume_dir", "resume_from"):
        if cfg.run[key]:
            cfg.run[key] = str(Path(cfg.run[key]).expanduser().resolve())


def load_config(overrides: list[str]) -> DictConfig:
    """Compose `conf/` with Hydra-style overrides and validate; returns a resolved, read-only config."""
    raw = compose(overrides)
    try:
        cfg = OmegaConf.merge(schema_for(raw), raw)
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        message = str(err).strip().splitlines()[0]
        raise ConfigError(f"{key}: renamed {RENAMED[key]}" if key in RENAMED else f"{key}: {message}") from err
    check_values(cfg)
    _absolutise_paths(cfg)
    if cfg.trainer.backend == "tp" and cfg.trainer.dp is None:
        cfg.trainer.dp = cfg.trainer.num_workers // cfg.trainer.tp
    OmegaConf.set_readonly(cfg, True)
    return cfg


def check_fits_this_machine(cfg: DictConfig) -> None:
    """Without RAY_ADDRESS the pipeline starts a Ray of its own on this machine: refuse more worker threads than
    the CPUs this process may use (Ray would start them all and crawl, or wait forever for a GPU)."""
    if os.environ.get("RAY_ADDRESS"):
        return  # a cluster: pipelines check its resources once connected
    trainer = cfg.trainer
    cpus = len(os.sched_getaffinity(0))
    threads, _ = worker_resources(trainer)
    if threads > cpus:
        fit = cpus // trainer.threads_per_worker
        raise ConfigError(f"trainer.num_workers: {trainer.num_workers} workers x {trainer.threads_per_worker} "
                          f"thread(s) need {threads} CPUs, this machine has {cpus} (at most {fit} such workers "
                          f"fit; set RAY_ADDRESS to train on a Ray cluster)")
    if trainer.use_gpu:
        import torch  # only here: a second or two, and only for GPU runs

        gpus = torch.cuda.device_count()
        if trainer.num_workers > gpus:
            raise ConfigError(f"trainer.use_gpu: {trainer.num_workers} workers need a GPU each, this machine has "
                              f"{gpus}; set RAY_ADDRESS to train on a Ray cluster")


def parallel_params(cfg: DictConfig) -> dict[str, Any]:
    """The parallelism degrees every run and sweep trial logs as params (the scaling report reads them)."""
    dp, tp = parallel_degrees(cfg.trainer)
    return {"world_size": cfg.trainer.num_workers, "dp": dp, "tp": tp, "backend": cfg.trainer.backend}


def flatten(cfg: DictConfig) -> dict[str, Any]:
    """`{"trainer.lr": 0.001, ...}` for MLflow params."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out
