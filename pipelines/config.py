"""Config: the run's plugins are imported (a user's models and datasets register themselves), Hydra composes `conf/`
with a command's overrides, the typed schemas of contract/config.py (one trainer schema per backend, the model's
from its spec) type it, and pipelines/checks.py validates it against itself and the prepared data, before Ray or
MLflow is touched.

Every error is a `ConfigError` whose message starts with the offending key; the commands print it on one line and
exit with code 2.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from contract.config import layout_of, schema, worker_resources
from contract.data import DataSchema, manifest_json
from contract.metrics import eval_metric
from contract.registry import BACKENDS, DATASETS, MODELS, RegistryError, entry_point_plugins, load_plugins, resolve
import pipelines.data  # noqa: F401  (registers the built-in datasets)
from pipelines.checks import check_data, check_values, read_data_schema
from contract.checks import ConfigError, installed

__all__ = ["CONF_DIR", "ConfigError", "check_fits_this_machine", "compose", "flatten", "group_choices",
           "installed", "load_config", "load_user_plugins", "parallel_params", "schema_for"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONFIG_GROUPS = ("trainer", "data", "model", "sweep")  # a choice of each: a backend, a dataset, a model, a sweep


def schema_for(cfg: DictConfig) -> DictConfig:
    """The typed schema of the backend and model the composed config names: a key of another backend's schema
    is then an unknown key."""
    backend = OmegaConf.select(cfg, "trainer.backend")
    if backend not in BACKENDS:
        raise ConfigError(f"trainer.backend: unknown backend '{backend}' (choices: {', '.join(BACKENDS.names())})")
    model_name = OmegaConf.select(cfg, "model.name")
    if model_name not in MODELS:
        raise ConfigError(f"model.name: unknown model '{model_name}' (registered: {', '.join(MODELS.names())}; "
                          f"a model of your own: plugins=[your.module])")
    return schema(backend, model_name)


# Keys that were renamed: an override of the old name is one line naming the new one.
RENAMED = {"trainer.tf_devices": "trainer.devices_per_worker"}


def group_choices(group: str) -> list[str]:
    """The options of a config group (`trainer`, `data`, `model`, `sweep`): the registered backends, models and
    datasets (a dataset with a default path), and the presets of conf/<group>/ (a sweep, `model=bert_tiny`)."""
    registered = {"trainer": BACKENDS.names(), "model": MODELS.names(),
                  "data": [name for name, spec in DATASETS.specs.items() if spec.default_path]}.get(group, [])
    return sorted({path.stem for path in (CONF_DIR / group).glob("*.yaml")} | set(registered))


def plugin_modules(overrides: list[str]) -> list[str]:
    """The plugin modules a command loads: `plugins=[...]` (or `+plugins=...`) among its overrides, then those of
    installed packages' `rtp.plugins` entry points."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    named: list[str] = []
    wanted = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "plugins"]
    try:
        for override in OverridesParser.create().parse_overrides(wanted):
            value = override.value()
            named += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    except HydraException as err:
        raise ConfigError(f"plugins: {str(err).strip().splitlines()[0]}") from err
    return [*named, *(m for m in entry_point_plugins() if m not in named)]


def load_user_plugins(overrides: list[str]) -> list[str]:
    """Import the command's plugin modules (they register their specs) and give Hydra every registered spec's
    keys and defaults (`store_config_groups`). ConfigError in one line naming a plugin that fails, before any
    cluster work."""
    modules = plugin_modules(overrides)
    try:
        load_plugins(modules)
    except RegistryError as err:
        raise ConfigError(str(err)) from err
    store_config_groups()
    return modules


def store_config_groups() -> None:
    """Every key's default is stated once, in its dataclass: Hydra composes conf/config.yaml on the shared
    sections (`shared_sections`: run, fault, plugins), and each registered backend, model and dataset is a choice
    of its group with its config's keys (`trainer=<backend>`, `model=<model>`, `data=<dataset>`), as a user's are.
    A key an override names must be one of them, of its type."""
    from hydra.core.config_store import ConfigStore

    from contract.config import DataConfig, shared_sections

    store = ConfigStore.instance()
    store.store(name="shared_sections", node=shared_sections())
    for spec in BACKENDS.specs.values():
        store.store(group="trainer", name=spec.name, node=spec.config)
    for spec in MODELS.specs.values():
        store.store(group="model", name=spec.name, node=OmegaConf.merge(OmegaConf.structured(spec.config),
                                                                          {"name": spec.name}))
    for spec in DATASETS.specs.values():
        if spec.default_path:
            store.store(group="data", name=spec.name, node=OmegaConf.merge(
                OmegaConf.structured(DataConfig), {"name": spec.name, "path": spec.default_path, **spec.data_keys}))


def compose(overrides: list[str]) -> DictConfig:
    """`conf/config.yaml` with Hydra-style overrides, not yet typed or checked; ConfigError in one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    load_user_plugins(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="config", overrides=overrides)
    except HydraException as err:
        if isinstance(err.__cause__, ValidationError):  # a value its key's type refuses
            raise typed_error(err.__cause__) from err
        raise ConfigError(_compose_error(str(err).strip().splitlines()[0])) from err


def typed_error(err: OmegaConfBaseException) -> ConfigError:
    """What the typed config refuses (an unknown key, a value of another type), in one line naming its key."""
    key = getattr(err, "full_key", None) or "config"
    if key in RENAMED:
        return ConfigError(f"{key}: renamed {RENAMED[key]}")
    if isinstance(err, ConfigKeyError):
        return ConfigError(unknown_key(key))
    return ConfigError(f"{key}: {str(err).strip().splitlines()[0]}")


def unknown_key(key: str) -> str:
    return (f"{key}: not a key of this config{_did_you_mean(key)} (each backend has its own trainer keys: rtp config "
            f"--help)")


def _compose_error(first_line: str) -> str:
    """Hydra's error as our one line: an unknown key (renamed, or did you mean), an unknown group choice."""
    unknown = re.fullmatch(r"Could not override '([\w.]+)'\.", first_line)
    if unknown and unknown[1] in RENAMED:
        return f"{unknown[1]}: renamed {RENAMED[unknown[1]]}"
    if unknown:
        return unknown_key(unknown[1])
    choice = re.search(r"Could not find '(\w+)/([^']+)'", first_line)
    if choice and choice[1] in CONFIG_GROUPS:
        return f"{choice[1]}: unknown choice '{choice[2]}' (choices: {', '.join(group_choices(choice[1]))})"
    unparsed = re.fullmatch(r"Error parsing override '([^']*)'", first_line) or \
        re.fullmatch(r"LexerNoViableAltException: (.*)", first_line)
    if unparsed:  # a value the shell split at a space, or characters Hydra's grammar takes only quoted
        return (f"overrides: cannot read '{unparsed[1]}': every argument is KEY=VALUE; quote a value with spaces "
                f"or other characters for the shell and for Hydra, e.g. \"run.name='my run'\"")
    return f"overrides: {first_line}"


def _did_you_mean(key: str) -> str:
    """` (a key of trainer=fsdp, tp)` for another backend's (or model's) key, ` (did you mean trainer.epochs?)` for
    a typo of a key of any backend's or model's config, else ''."""
    import difflib

    group = "model" if key.startswith("model.") else "trainer"
    keys: set[str] = set()
    owners: set[str] = set()  # the backends (or models) whose config has the key
    for backend in BACKENDS.names():
        for model in MODELS.names():
            found = flatten(schema(backend, model))
            keys.update(found)
            if key in found:
                owners.add(model if group == "model" else backend)
    if owners:
        return f" (a key of {group}={', '.join(sorted(owners))})"
    close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def _absolutise_paths(cfg: DictConfig) -> None:
    # The job may run from a copy of the repo (ray job --working-dir): pin paths to where they were given.
    cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    cfg.run.storage_path = str(Path(cfg.run.storage_path).expanduser().resolve())
    for key in ("dump_params_dir", "resume_dir", "resume_from"):
        if cfg.run[key]:
            cfg.run[key] = str(Path(cfg.run[key]).expanduser().resolve())
    if cfg.trainer.get("deepspeed_config"):  # each worker reads it again
        cfg.trainer.deepspeed_config = str(Path(cfg.trainer.deepspeed_config).expanduser().resolve())


def load_config(overrides: list[str]) -> DictConfig:
    """Compose `conf/` with Hydra-style overrides and validate, against the prepared data too; returns a resolved,
    read-only config. `plugins` lists every plugin module loaded (named, or an installed entry point's); the data's
    manifest names the dataset (`data.name`) and its task, whose evaluation metric `run.monitor` is unless
    given."""
    cfg = checked_values(overrides)
    inputs = read_data_schema(cfg.data)
    cfg.data.name = inputs.dataset
    if cfg.data.eval_split is None:
        cfg.data.eval_split = default_eval_split(cfg.data)
    if cfg.data.cache_in_worker == "auto":  # an elastic run streams (pipelines/checks.py says why)
        cfg.data.cache_in_worker = not cfg.trainer.min_workers and shard_bytes(cfg, inputs) <= cfg.data.cache_max_bytes
    if cfg.run.monitor is None:
        cfg.run.monitor = eval_metric(inputs.target.task)
    check_data(cfg, inputs)
    _absolutise_paths(cfg)
    complete = BACKENDS.get(cfg.trainer.backend).complete
    if complete is not None:
        resolve(complete)(cfg.trainer)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def checked_values(overrides: list[str]) -> DictConfig:
    """The composed, typed config of `overrides` with every check that needs no prepared data (`check_values`):
    the first part of `load_config`, and what the docs' commands are checked with."""
    raw = compose(overrides)
    try:
        # As plain data: Hydra types each group choice already, but lets `+key=...` add keys its type lacks.
        cfg = OmegaConf.merge(schema_for(raw), OmegaConf.to_container(raw))
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise typed_error(err) from err
    cfg.plugins = plugin_modules(overrides)  # the entry points' too: every worker loads what the driver did
    check_values(cfg)
    return cfg


def default_eval_split(data: DictConfig) -> str:
    """The split a run evaluates each epoch on unless told: `validation` where the prepared data has one (the test
    split stays unseen by model selection), else `test`."""
    return "validation" if "validation" in manifest_json(data.path).get("splits", {}) else "test"


def shard_bytes(cfg: DictConfig, inputs: DataSchema) -> int:
    """The bytes of a worker's part of the train split held in memory: what `data.cache_in_worker=auto` weighs
    against `data.cache_max_bytes`."""
    # (a manifest without row counts: checked when the run reads it)
    rows = manifest_json(cfg.data.path).get("splits", {}).get("train", {}).get("rows", 0)
    return rows * inputs.row_bytes() // layout_of(cfg.trainer).epoch_ranks


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
    workers = layout_of(trainer).ray_workers
    if trainer.placement_strategy == "STRICT_SPREAD" and workers > 1:
        raise ConfigError(f"trainer.placement_strategy: STRICT_SPREAD puts each of the {workers} Ray workers on its "
                          f"own node; a Ray of this machine's own has one (set RAY_ADDRESS to train on a Ray cluster)")
    if trainer.use_gpu:
        import torch  # only here: a second or two, and only for GPU runs

        gpus = torch.cuda.device_count()
        if trainer.num_workers > gpus:
            raise ConfigError(f"trainer.use_gpu: {trainer.num_workers} workers need a GPU each, this machine has "
                              f"{gpus}; set RAY_ADDRESS to train on a Ray cluster")


def parallel_params(cfg: DictConfig) -> dict[str, Any]:
    """The parallelism degrees every run and sweep trial logs as params (the scaling report reads them)."""
    layout = layout_of(cfg.trainer)
    return {"world_size": cfg.trainer.num_workers, "dp": layout.dp, "tp": layout.tp, "backend": cfg.trainer.backend}


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
