"""The sweep's plan, before Ray starts: the sweep config (`conf/sweep/*.yaml`), its search space expanded into
trials, and every impossible combination rejected with its reason.

The search space (`grid`) maps override keys to a list of values (a grid axis: every value is tried) or to one
distribution: `{choice: [values]}`, `{uniform: [low, high]}`, `{loguniform: [low, high]}` or
`{randint: [low, high]}` (high excluded), Ray Tune's semantics. `num_samples` repeats the grid, each time with
fresh draws of the distributions. The draws are made here, seeded by `seed`, rather than by a Tune search
algorithm: every trial is then a concrete config, validated before launch and the same when a stopped sweep
is continued.

A trial is a list of Hydra overrides on top of the training config; it is valid when `load_config` accepts it
(the same validation as `pipelines.train`: tp*dp = workers, tp | heads, ...) and the cluster can hold it.
"""
from __future__ import annotations

import difflib
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contract.config import layout_of, worker_resources
from contract.metrics import ALL_EPOCH_METRICS
from contract.registry import BACKENDS, MODELS, resolve
from pipelines.config import ConfigError, load_config

# CPUs a trial takes besides its workers: its Tune function (the Ray Train driver) and one for Ray Data's
# read/split tasks, which would wait forever if the trials' workers held every CPU.
TRIAL_DRIVER_CPUS = 1
DATA_CPUS = 1
SCHEDULERS = ("fifo", "grid", "asha", "pbt")  # grid: the former name of fifo
MODES = ("min", "max")
DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")
SIGNIFICANT_DIGITS = 4  # of a drawn float: what the trial runs with, its override and its run name agree


@dataclass
class SweepConfig:
    name: str = "parallelism"           # the preset's name (conf/sweep/<name>.yaml; a file's: its stem)
    overrides: list[str] = field(default_factory=list)  # training overrides every trial starts from
    grid: Any = None                    # the search space: {override key: [values] | {distribution: args}} or a
                                        # list of such mappings (their union)
    num_samples: int = 1                # the grid this many times, each with fresh draws of its distributions
    seed: int = 0                       # of the draws
    stop: Any = None                    # {epoch metric: value}: a trial stops once it reaches one (losses: <=)
    time_budget_s: Optional[float] = None  # the whole sweep: after this, Tune stops its trials and starts no more
    scheduler: str = "fifo"             # fifo: every trial runs to the end | asha: stop poor trials early |
                                        # pbt: poor trials continue from good ones' checkpoints (pipelines/sweep/pbt.py)
    metric: str = "test_accuracy"       # best configuration (and ASHA) by this metric of the report (test_mse for
                                        # regression data, with mode min)
    mode: str = "max"                   # max | min
    target_accuracy: float = 0.8        # report: training time until test_accuracy first reaches this
    max_concurrent_trials: Optional[int] = None  # default (and cap): what the cluster holds at once
    trial_max_failures: int = 1         # Tune restarts a failed trial this often (it resumes its checkpoint)
    asha_grace_period: int = 1          # asha: epochs every trial runs before it can be stopped
    mutations: Any = None               # pbt: {recipe key: [values] | {distribution: args}} that exploiters perturb
    pbt_interval: int = 1               # pbt: epochs between perturbations
    pbt_quantile: float = 0.25          # pbt: the bottom fraction of trials continues from the top fraction
    pbt_synch: bool = False             # pbt: every trial waits at each perturbation (paused, later restarted)


@dataclass
class Trial:
    index: int
    combo: dict[str, Any]               # the grid point, {override key: value}
    overrides: list[str]                # all training overrides of this trial
    cfg: Optional[DictConfig] = None    # validated training config (None when rejected)
    reason: str = ""                    # why it was rejected


def split_argv(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(sweep name, `sweep.*` overrides, training overrides) from the command line."""
    name, sweep_overrides, train_overrides = "parallelism", [], []
    for arg in argv:
        if arg.startswith("sweep="):
            name = arg.split("=", 1)[1]
        elif arg.startswith(("sweep.", "+sweep.", "~sweep.")):
            sweep_overrides.append(arg)
        else:
            train_overrides.append(arg)
    return name, sweep_overrides, train_overrides


def load_sweep(name: str, overrides: list[str]) -> DictConfig:
    """Compose `conf/sweep/<name>.yaml` (the config group `sweep`), or a sweep file of the user's
    (`sweep=path/to/mine.yaml`), with `sweep.*` overrides, and validate."""
    from pipelines.config import compose

    if name.endswith((".yaml", ".yml")):
        name = store_sweep_file(Path(name))

    keys = list(SweepConfig.__dataclass_fields__)
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").removeprefix("sweep.").split(".")[0]
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            raise ConfigError(f"sweep.{key}: not a sweep key{f' (did you mean sweep.{close[0]}?)' if close else ''}"
                              f" (keys: {', '.join(keys)})")
    # Every SweepConfig key can be set, including those a yaml file leaves at their default (`++`: add or set).
    overrides = [o if o.startswith("~") else f"++{o.lstrip('+')}" for o in overrides]
    raw = compose([f"+sweep={name}", *overrides]).sweep
    try:
        spec = OmegaConf.merge(OmegaConf.structured(SweepConfig), raw)
    except OmegaConfBaseException as err:
        raise ConfigError(f"sweep.{getattr(err, 'full_key', '') or 'config'}: {str(err).splitlines()[0]}") from err
    _check_sweep(spec)
    return spec


def store_sweep_file(path: Path) -> str:
    """A user's sweep file as the `sweep` group's choice `_file` (its `name`: the file's, else its stem), so that
    it composes and takes overrides as the presets do. ConfigError in one line when it cannot be read."""
    from hydra.core.config_store import ConfigStore
    from yaml import MarkedYAMLError, YAMLError

    if not path.is_file():
        raise ConfigError(f"sweep: {path}: no such file")
    try:
        loaded = OmegaConf.load(path)
    except MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = ": ".join(" ".join(str(part).split()) for part in (err.context, err.problem) if part)
        raise ConfigError(f"sweep: {where}: not a readable YAML file ({what or str(err).splitlines()[0]})") from err
    except (OSError, YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"sweep: {path}: not a readable YAML file ({str(err).splitlines()[0]})") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"sweep: {path}: holds a {type(loaded).__name__}, not a mapping of sweep keys")
    ConfigStore.instance().store(group="sweep", name="_file", node=OmegaConf.merge({"name": path.stem}, loaded))
    return "_file"


def _check_sweep(spec: DictConfig) -> None:
    if spec.scheduler not in SCHEDULERS:
        raise ConfigError(f"sweep.scheduler: unknown '{spec.scheduler}' (choices: {SCHEDULERS})")
    from pipelines.sweep.report import NUMERIC

    if spec.metric not in NUMERIC:
        raise ConfigError(f"sweep.metric: '{spec.metric}' is not a report column (choices: {NUMERIC})")
    if spec.scheduler in ("asha", "pbt") and spec.metric not in ALL_EPOCH_METRICS:
        raise ConfigError(f"sweep.metric: {spec.scheduler} needs a metric every epoch reports, got '{spec.metric}' "
                          f"(choices: {ALL_EPOCH_METRICS})")
    if spec.mode not in MODES:
        raise ConfigError(f"sweep.mode: unknown '{spec.mode}' (choices: {MODES})")
    if spec.max_concurrent_trials is not None and spec.max_concurrent_trials < 1:
        raise ConfigError(f"sweep.max_concurrent_trials: must be >= 1, got {spec.max_concurrent_trials}")
    if spec.trial_max_failures < 0:
        raise ConfigError(f"sweep.trial_max_failures: must be >= 0, got {spec.trial_max_failures}")
    if spec.time_budget_s is not None and spec.time_budget_s <= 0:
        raise ConfigError(f"sweep.time_budget_s: must be > 0 (null: no budget), got {spec.time_budget_s}")
    if spec.num_samples < 1:
        raise ConfigError(f"sweep.num_samples: must be >= 1, got {spec.num_samples}")
    stop_thresholds(spec)
    for grid in grids(spec):
        for key, axis in grid.items():
            check_axis(key, axis)


def check_axis(key: str, axis: Any, where: str = "sweep.grid") -> None:
    """A grid axis is a non-empty list; a distribution is one of DISTRIBUTIONS with valid arguments."""
    if isinstance(axis, list):
        if not axis:
            raise ConfigError(f"{where}: '{key}' needs a non-empty list of values")
        return
    if not isinstance(axis, dict) or len(axis) != 1 or next(iter(axis)) not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: '{key}' needs a list of values or one of {{{'|'.join(DISTRIBUTIONS)}: "
                          f"...}}, got {axis}")
    kind, args = next(iter(axis.items()))
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}: '{key}': choice needs a non-empty list, got {args}")
        return
    numbers = isinstance(args, list) and len(args) == 2 and all(isinstance(a, (int, float)) for a in args)
    if not numbers or not args[0] < args[1]:
        raise ConfigError(f"{where}: '{key}': {kind} needs [low, high] with low < high, got {args}")
    if kind == "loguniform" and args[0] <= 0:
        raise ConfigError(f"{where}: '{key}': loguniform needs low > 0, got {args}")
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}: '{key}': randint needs integers, got {args}")


def stop_thresholds(spec: DictConfig) -> dict[str, tuple[float, str]]:
    """`sweep.stop` as {metric: (threshold, "max" | "min")}: a loss or an error is reached from above, the rest from
    below."""
    raw = OmegaConf.to_container(spec.stop) if OmegaConf.is_config(spec.stop) else spec.stop
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"sweep.stop: expected {{epoch metric: value}}, got {raw}")
    thresholds = {}
    for metric, value in raw.items():
        if metric not in ALL_EPOCH_METRICS:
            raise ConfigError(f"sweep.stop: '{metric}' is not an epoch metric (choices: {ALL_EPOCH_METRICS})")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"sweep.stop: '{metric}' needs a number, got {value}")
        thresholds[metric] = (float(value), "min" if metric.endswith(("loss", "mse")) else "max")
    return thresholds


def grids(spec: DictConfig) -> list[dict[str, list]]:
    """The sweep's grids as plain dicts (one mapping is a list of one)."""
    if spec.grid is None:
        raise ConfigError("sweep.grid: missing; give {override key: [values]} or a list of such mappings")
    raw = OmegaConf.to_container(spec.grid, resolve=True) if OmegaConf.is_config(spec.grid) else spec.grid
    raw = [raw] if isinstance(raw, dict) else raw
    if not raw or not all(isinstance(g, dict) and g for g in raw):
        raise ConfigError(f"sweep.grid: expected a mapping or a list of non-empty mappings, got {raw}")
    return raw


def expand_grid(grid_list: list[dict[str, Any]], num_samples: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """Every point of every grid (cartesian product of its value lists; a point of two grids once), in order,
    `num_samples` times, each time with fresh draws of the distributions (Tune's order: sample by sample)."""
    rng = np.random.default_rng(seed)
    points: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (grid point, its grid's distributions)
    for grid in grid_list:
        axes = {key: axis for key, axis in grid.items() if isinstance(axis, list)}
        distributions = {key: axis for key, axis in grid.items() if not isinstance(axis, list)}
        for values in itertools.product(*axes.values()):
            point = (dict(zip(axes, values)), distributions)
            if point not in points:
                points.append(point)
    expanded = []
    for _ in range(num_samples):
        for point, distributions in points:
            drawn = {**point, **{key: draw(axis, rng) for key, axis in distributions.items()}}
            expanded.append({key: drawn[key] for key in [*point, *distributions]})
    return expanded


def draw(distribution: dict[str, Any], rng: np.random.Generator) -> Any:
    """One value of `{choice|uniform|loguniform|randint: args}`; floats to SIGNIFICANT_DIGITS."""
    kind, args = next(iter(distribution.items()))
    if kind == "choice":
        return args[int(rng.integers(len(args)))]
    if kind == "randint":
        return int(rng.integers(args[0], args[1]))
    low, high = (math.log(args[0]), math.log(args[1])) if kind == "loguniform" else args
    value = rng.uniform(low, high)
    return float(f"{math.exp(value) if kind == 'loguniform' else value:.{SIGNIFICANT_DIGITS}g}")


def format_override(key: str, value: Any) -> str:
    """`key=value` in Hydra's syntax (lists as `[a,b]`)."""
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    if value is None:
        return f"{key}=null"
    return f"{key}={value}"


def merge_overrides(*lists: list[str]) -> list[str]:
    """One override per key, the last given wins (Hydra refuses a config group chosen twice); config group
    choices (`trainer=tp`) first, so that value overrides land on the chosen group."""
    merged: dict[str, str] = {}
    for overrides in lists:
        for override in overrides:
            key = override.split("=", 1)[0]
            merged.pop(key, None)
            merged[key] = override
    groups = [o for k, o in merged.items() if "." not in k.lstrip("+~")]
    values = [o for k, o in merged.items() if "." in k.lstrip("+~")]
    return groups + values


def plan_trials(spec: DictConfig, train_overrides: list[str]) -> list[Trial]:
    """Every point of the search space as a trial, validated like `pipelines.train` validates a run; invalid ones keep
    their `ConfigError` message as the reason."""
    trials = []
    for index, combo in enumerate(expand_grid(grids(spec), spec.num_samples, spec.seed)):
        combo_overrides = [format_override(k, v) for k, v in combo.items()]
        overrides = merge_overrides(list(spec.overrides), train_overrides, combo_overrides)
        trial = Trial(index=index, combo=combo, overrides=overrides)
        try:
            trial.cfg = load_config(overrides)
        except ConfigError as err:
            trial.reason = str(err)
        trials.append(trial)
    return trials


def cpus_needed(cfg: DictConfig) -> float:
    return worker_resources(cfg.trainer)[0] + TRIAL_DRIVER_CPUS + DATA_CPUS


def gpus_needed(cfg: DictConfig) -> float:
    return worker_resources(cfg.trainer)[1]


def reject_ignored(trials: list[Trial], mutated: list[str]) -> None:
    """Reject valid trials whose grid point or mutations (`mutated`, PBT's keys) set a key their backend and model
    do not read (the backend spec's `ignored_keys`): the trial would train what another trial trains."""
    for trial in trials:
        if trial.cfg is None:
            continue
        ignored_keys = BACKENDS.get(trial.cfg.trainer.backend).ignored_keys
        if ignored_keys is None:
            continue
        ignored, why = resolve(ignored_keys)(trial.cfg, MODELS.get(trial.cfg.model.name))
        swept = sorted({key.lstrip("+") for key in [*trial.combo, *mutated]} & set(ignored))
        if swept:
            verb = "changes" if len(swept) == 1 else "change"
            trial.cfg, trial.reason = None, f"sweep: {', '.join(swept)} {verb} nothing here: {why}"


def reject_unfit(trials: list[Trial], cluster_cpus: float, cluster_gpus: float) -> None:
    """Reject valid trials that the whole cluster could never hold at once: Ray Train would wait forever."""
    for trial in trials:
        if trial.cfg is None:
            continue
        trainer = trial.cfg.trainer
        cpus, gpus = cpus_needed(trial.cfg), gpus_needed(trial.cfg)
        if cpus > cluster_cpus:
            trial.reason = (f"cluster: needs {cpus:g} CPUs ({trainer.num_workers} workers x "
                            f"{trainer.threads_per_worker} threads + {TRIAL_DRIVER_CPUS} trial driver + "
                            f"{DATA_CPUS} Ray Data), the cluster has {cluster_cpus:g}")
        elif gpus > cluster_gpus:
            trial.reason = (f"cluster: needs {gpus:g} GPUs ({trainer.num_workers} workers), "
                            f"the cluster has {cluster_gpus:g}")
        if trial.reason:
            trial.cfg = None


def max_concurrent(valid: list[Trial], cluster_cpus: float, cluster_gpus: float, requested: int | None) -> int:
    """How many trials can run at once whatever trials the grid puts side by side: the cluster divided by
    the largest trial's needs (Ray Train starts a run only when all its workers fit, so more concurrent
    trials than this can leave several runs each holding part of what they need). `requested` only lowers it."""
    largest_cpus = max(cpus_needed(t.cfg) for t in valid)
    largest_gpus = max(gpus_needed(t.cfg) for t in valid)
    fit = int(cluster_cpus // largest_cpus)
    if largest_gpus:
        fit = min(fit, int(cluster_gpus // largest_gpus))
    fit = max(fit, 1)
    return min(fit, requested) if requested else fit


# Grid keys the start of a trial's name already shows.
NAMED_KEYS = {"trainer", "trainer.num_workers", "trainer.tp", "trainer.dp", "trainer.batch_size", "trainer.lr"}


def trial_name(trial: Trial) -> str:
    """The trial's MLflow run name: its backend and layout, batch and learning rate, then each other key of its grid
    point (`model.hidden=8`). Trials of equal points (`sweep.num_samples` without distributions) share it."""
    t = trial.cfg.trainer
    layout = layout_of(t)
    parts = [f"{t.backend}-w{t.num_workers}-tp{layout.tp}-dp{layout.dp}-bs{t.batch_size}-lr{t.lr:g}"]
    parts += [f"{key}={value}" for key, value in trial.combo.items() if key.lstrip("+") not in NAMED_KEYS]
    return "-".join(parts)
