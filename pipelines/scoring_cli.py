"""What `pipelines.evaluate` and `pipelines.predict` share before scoring starts: their common arguments, the
model lookup in MLflow, the checks that the scoring actors fit, and the Ray they score on."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contract import tracking
from contract.console import quiet_ray_env, quiet_ray_logs, ray_init_logging
from pipelines.config import ConfigError
from pipelines.data.idx import DataError
from pipelines.ray_session import connect_or_start_ray, ray_address_problem

RUN_ID = re.compile(r"[0-9a-f]{32}")
# What main() reports in one line with exit code 2: nothing was started.
USAGE_ERRORS = (ConfigError, DataError, tracking.TrackingUnavailable)


@dataclass
class ScoringConfig:
    model: str = MISSING  # a run id, runs:/<run id>/model, models:/<name>/<version>, models:/<name>@<alias>
    batch_size: int = 256  # rows per batch a scoring actor takes
    concurrency: int = 1  # scoring actors, a CPU each (a GPU each with use_gpu)
    use_gpu: bool = False  # score on GPUs, one per actor
    verbose: bool = False  # Ray's own INFO lines too (data plans, per-operator progress); `-v`


def parse_args(schema: type, argv: list[str]) -> Any:
    """`key=value` arguments checked against `schema` (a ScoringConfig dataclass); ConfigError names the key."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(argv))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "arguments"
        raise ConfigError(f"{key}: {str(err).strip().splitlines()[0]}") from err
    except yaml.YAMLError as err:  # a value OmegaConf reads as YAML, e.g. one starting with a quote
        where = next((arg.split("=", 1)[0] for arg in argv if not _reads_as_yaml(arg)), "arguments")
        raise ConfigError(f"{where}: not a readable value ({type(err).__name__}); quote it for YAML too, e.g. "
                          f"\"{where}='...'\"") from None
    for key in sorted(OmegaConf.missing_keys(cfg)):
        raise ConfigError(f"{key}: Missing mandatory value")
    if not cfg.model:
        raise ConfigError("model: give a run id, runs:/<run id>/model or models:/<name>/<version>")
    if min(cfg.get("batch_size", 1), cfg.get("concurrency", 1)) < 1:
        raise ConfigError(f"batch_size and concurrency must be >= 1, got {cfg.batch_size} and {cfg.concurrency}")
    return cfg


def find_model(spec: str, uri: str) -> tuple[str, Any, Any]:
    """(model URI, its MLflow ModelInfo, the run that logged it or None) of a `model=` value; ConfigError if
    MLflow does not know it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(uri)
    model_uri = f"runs:/{spec}/model" if RUN_ID.fullmatch(spec) else spec
    try:
        info = mlflow.models.get_model_info(model_uri)
        run = mlflow.MlflowClient(uri).get_run(info.run_id) if info.run_id else None
    except (MlflowException, OSError) as err:
        raise ConfigError(f"model: {model_uri}: {str(err).strip().splitlines()[0]}") from err
    if info.signature is None:  # the scorers feed the model the input type its signature names
        raise ConfigError(f"model: {model_uri} was logged without a signature (log it with an input example, as "
                          f"`rtp train` does); its input type is not known")
    return model_uri, info, run


def _reads_as_yaml(arg: str) -> bool:
    try:
        OmegaConf.from_dotlist([arg])
        return True
    except (OmegaConfBaseException, yaml.YAMLError):
        return False


def check_actors_fit(cfg: Any) -> None:
    """Without RAY_ADDRESS a local Ray holds the scoring actors: as many as this machine has CPUs (or GPUs)."""
    if os.environ.get("RAY_ADDRESS"):
        return
    cpus = len(os.sched_getaffinity(0))
    if cfg.concurrency > cpus:
        raise ConfigError(f"concurrency: {cfg.concurrency} scoring actors need a CPU each, this machine has {cpus}"
                          " (set RAY_ADDRESS to score on a Ray cluster)")
    if cfg.use_gpu:
        import torch

        if cfg.concurrency > torch.cuda.device_count():
            raise ConfigError(f"use_gpu: {cfg.concurrency} scoring actors need a GPU each, this machine has "
                              f"{torch.cuda.device_count()}")


def checked_tracking_uri() -> str:
    """The tracking URI, its server answering; quiet artifact downloads, so that errors stay one line."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = tracking.tracking_uri()
    tracking.check_reachable(uri)
    return uri


def plan_before_start(argv: list[str], parse: Callable[[list[str]], Any],
                      resolve: Callable[[Any, str], Any]) -> tuple[Any, str, Any]:
    """(config, tracking URI, plan): every check that needs no Ray, in order; raises one of USAGE_ERRORS."""
    cfg = parse(argv)
    if problem := ray_address_problem():
        raise ConfigError(problem)
    uri = checked_tracking_uri()
    plan = resolve(cfg, uri)
    check_actors_fit(cfg)
    return cfg, uri, plan


def init_ray(actors: int, verbose: bool = False) -> None:
    """The cluster at RAY_ADDRESS, or a local Ray of our own with a CPU for the reads beside the actors; Ray's INFO
    lines off the console unless `verbose`."""
    if not verbose:
        quiet_ray_logs()
    quiet = {"runtime_env": {"env_vars": quiet_ray_env(verbose)}, **ray_init_logging(verbose)}
    connect_or_start_ray({"num_cpus": max(os.cpu_count() or 1, actors + 1), "include_dashboard": False, **quiet},
                         log_to_driver=True, **quiet)
