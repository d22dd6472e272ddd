"""The checks of a composed, typed training config: every value, and every combination a run could not train
(against the prepared data's manifest too: `check_data`), refused before Ray or MLflow is touched. Each failure
is a `ConfigError` whose message starts with the offending key; the commands print it on one line and exit with
code 2. Framework-free: a framework is found, never imported.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig

from contract import recipe
from contract.checkpoint import STATE_FILE, checkpoint_mismatch
from contract.checks import ConfigError, choice, installed
from contract.config import layout_of
from contract.data import MANIFEST, DataSchema, manifest_json
from contract.metrics import metric_names
from contract.progress import PROGRESS_SETTINGS
from contract.registry import DATASETS, MODELS, ModelSpec, resolve
from pipelines.data import data_schema
from trainers import BACKENDS, FRAMEWORKS, framework_of, model_builders

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
BUILDER_FIELDS = {"torch": "a PyTorch builder (torch=)", "keras": "a Keras builder (keras=)",
                  "dtensor": "a DTensor module builder (dtensor=)",
                  "lightning": "a LightningModule builder (lightning=)"}
POSITIVE = ("num_workers", "threads_per_worker", "batch_size", "lr", "epochs", "tf_steps_per_execution",
            "grad_accum", "devices_per_worker", "num_ps",
            "ps_min_shard_bytes")  # trainer keys, where the backend has them


def check_values(cfg: DictConfig) -> None:
    """Every check of the config itself, in the order a user would fix them: values, the framework, the model,
    the recipe, the layout."""
    for section in ("trainer", "model", "run", "fault"):  # lr=inf trains five epochs of NaN losses
        for key, value in cfg[section].items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{key}: must be a finite number, got {value}")
    for key in POSITIVE:
        if key in cfg.trainer and cfg.trainer[key] <= 0:
            raise ConfigError(f"trainer.{key}: must be > 0, got {cfg.trainer[key]}")
    if cfg.trainer.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"trainer.placement_strategy: unknown strategy '{cfg.trainer.placement_strategy}' "
                          f"(choices: {PLACEMENT_STRATEGIES})")
    _check_installed(cfg.trainer)
    _check_data_reading(cfg.data)
    _check_recipe(cfg)
    if cfg.trainer.max_steps_per_epoch is not None and cfg.trainer.max_steps_per_epoch < 1:
        raise ConfigError(f"trainer.max_steps_per_epoch: must be >= 1, got {cfg.trainer.max_steps_per_epoch}")
    if cfg.trainer.compile and framework_of(cfg.trainer) == "tf":
        raise ConfigError("trainer.compile: torch.compile is for the PyTorch backends (TensorFlow compiles its "
                          "training step with tf.function already)")
    spec = MODELS.get(cfg.model.name)
    _check_elastic(cfg)
    _check_backend(cfg, spec, None)  # its keys and layout
    _check_model(cfg, spec, None)  # its keys, and the layout against its sizes
    if cfg.run.nan_patience < 1:
        raise ConfigError(f"run.nan_patience: must be >= 1, got {cfg.run.nan_patience}")
    for key in ("checkpoint_every_n_steps", "checkpoint_every_s"):
        if cfg.run[key] < 0:
            raise ConfigError(f"run.{key}: must be >= 0 (0: at epoch ends only), got {cfg.run[key]}")
    if cfg.run.keep_checkpoints < 1:
        raise ConfigError(f"run.keep_checkpoints: must be >= 1, got {cfg.run.keep_checkpoints}")
    if cfg.run.straggler_ratio != 0 and cfg.run.straggler_ratio <= 1:
        raise ConfigError(f"run.straggler_ratio: must be above 1 (or 0: off), got {cfg.run.straggler_ratio}")
    if cfg.run.preflight_timeout_s <= 0:
        raise ConfigError(f"run.preflight_timeout_s: must be > 0, got {cfg.run.preflight_timeout_s}")
    if cfg.fault.max_failures < 0:
        raise ConfigError(f"fault.max_failures: must be >= 0, got {cfg.fault.max_failures}")
    if cfg.fault.resource_timeout_s < 0:
        raise ConfigError(f"fault.resource_timeout_s: must be >= 0 (0: wait forever), "
                          f"got {cfg.fault.resource_timeout_s}")
    if cfg.fault.hang_timeout_s < 0:
        raise ConfigError(f"fault.hang_timeout_s: must be >= 0 (0: off), got {cfg.fault.hang_timeout_s}")
    if cfg.fault.collective_timeout_s < 1:
        raise ConfigError(f"fault.collective_timeout_s: must be >= 1, got {cfg.fault.collective_timeout_s}")
    if cfg.fault.inject_hang_at_step is not None and not cfg.fault.inject_marker:
        raise ConfigError("fault.inject_hang_at_step: needs fault.inject_marker (the hang fires once)")
    if cfg.fault.inject_at_step is not None and (not cfg.fault.inject_marker or cfg.fault.inject_at_epoch is not None):
        raise ConfigError("fault.inject_at_step: needs fault.inject_marker (the failure fires once) and no "
                          "fault.inject_at_epoch (one injection at a time)")
    if cfg.run.system_metrics_interval_s < 1:  # a request per sample per process: more would flood the server
        raise ConfigError(f"run.system_metrics_interval_s: must be >= 1, got {cfg.run.system_metrics_interval_s}")
    for key in ("dropout", "attention_dropout"):
        if key in cfg.model and not 0 <= cfg.model[key] < 1:
            raise ConfigError(f"model.{key}: must be in [0, 1), got {cfg.model[key]}")
    if cfg.run.resume_from and not (Path(cfg.run.resume_from) / STATE_FILE).is_file():
        raise ConfigError(f"run.resume_from: no checkpoint at '{cfg.run.resume_from}' (missing {STATE_FILE})")
    if cfg.run.resume_from and (why := checkpoint_mismatch(cfg.run.resume_from, cfg.trainer.backend, cfg.model.name)):
        raise ConfigError(f"run.resume_from: {cfg.run.resume_from}: {why}")


def _check_elastic(cfg: DictConfig) -> None:
    """An elastic run (`trainer.min_workers`): a backend that can change its number of workers, a global batch that
    splits evenly at every size between min_workers and num_workers, and streamed data."""
    trainer = cfg.trainer
    if not trainer.min_workers:
        return
    if not 1 <= trainer.min_workers < trainer.num_workers:
        raise ConfigError(f"trainer.min_workers: must be between 1 and num_workers - 1 = {trainer.num_workers - 1} "
                          f"(0: not elastic), got {trainer.min_workers}")
    if not BACKENDS.get(trainer.backend).elastic:
        elastic = ", ".join(name for name in BACKENDS.names() if BACKENDS.get(name).elastic)
        raise ConfigError(f"trainer.min_workers: trainer={trainer.backend} keeps the number of workers it starts "
                          f"with (its layout or its checkpoints are made for one); elastic runs: {elastic}")
    rows = trainer.batch_size * trainer.num_workers
    uneven = [size for size in range(trainer.min_workers, trainer.num_workers) if rows % size]
    if uneven:
        raise ConfigError(f"trainer.min_workers: the global batch of {rows} rows (batch_size x num_workers) does not "
                          f"split evenly over {', '.join(map(str, uneven))} worker(s), which an elastic run keeps at "
                          f"any size; pick a batch_size it does")
    if cfg.data.cache_in_worker is True:
        raise ConfigError("data.cache_in_worker: an elastic run streams its data (false, or auto): a part held in "
                          "memory is cut for one number of workers")
    if trainer.resize_check_s <= 0:
        raise ConfigError(f"trainer.resize_check_s: must be > 0, got {trainer.resize_check_s}")


RUN_FOLDERS = ("resume_dir", "storage_path", "dump_params_dir")  # run keys naming folders the run writes


def check_run_folders(run: DictConfig) -> None:
    """The run's folders on this machine (`run.resume_dir`, a local `run.storage_path`, `run.dump_params_dir`):
    each a folder this user can write in, or one it can create; checked, not created. A driver's, so not part of
    `check_values`: `rtp config` may run on another machine than the job's driver."""
    for key in RUN_FOLDERS:
        path = run.get(key)
        if path and "://" not in str(path):  # a URI (s3://, gs://) is Ray's to reach
            why = unwritable_folder(Path(path))
            if why:
                raise ConfigError(f"run.{key}: {path} {why}")


def unwritable_folder(path: Path) -> str | None:
    """Why `path` cannot be a folder this user writes in, or None."""
    if path.exists():
        if not path.is_dir():
            return "is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a folder this user cannot write in"
    parent = next(folder for folder in path.absolute().parents if folder.exists())
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: this user cannot write in {parent}"


def read_data_schema(data: DictConfig) -> DataSchema:
    """The prepared dataset's features and target, from its manifest (read, not its shards: `fit` checks those)."""
    manifest = Path(data.path) / MANIFEST
    if not manifest.is_file():
        raise ConfigError(f"data.path: no prepared dataset at '{data.path}' (missing {MANIFEST}); "
                          f"{prepare_hint(data)}")
    try:  # a manifest from before manifests named their layout: the dataset's the config names (mnist, imdb)
        return data_schema({"dataset": data.name, **manifest_json(data.path)})
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"data.path: {manifest} does not describe its features and target ({err}); prepare it "
                          f"again with `rtp prepare`") from err


def prepare_hint(data: DictConfig) -> str:
    """How to prepare the dataset `data` names: its own command where the path is its default one (`data=imdb`),
    else a table of the user's or that dataset."""
    spec = DATASETS.specs.get(data.name)
    if spec is not None and spec.default_path and Path(data.path).resolve() == Path(spec.default_path).resolve():
        return f"run `rtp prepare {data.name} --out {data.path}`"
    return (f"prepare your own table there with `rtp prepare table --source <CSV, Parquet or dataset folder> "
            f"--label <column> --out {data.path}`, or `rtp prepare {data.name} --out {data.path}`")


def check_data(cfg: DictConfig, inputs: DataSchema) -> None:
    """The config against the prepared data: the model takes its features and task, the backend can train that,
    the monitored metric is one the run logs, and every rank gets a batch."""
    spec = MODELS.get(cfg.model.name)
    features, task = inputs.features.kind, inputs.target.task
    if features not in spec.inputs:
        fitting = [name for name, other in MODELS.specs.items() if features in other.inputs and task in other.tasks]
        raise ConfigError(f"model.name: model '{spec.name}' takes {'/'.join(spec.inputs)} features; "
                          f"'{inputs.dataset}' has {features} features (models for it: {', '.join(fitting)})")
    if task not in spec.tasks:
        raise ConfigError(f"model.name: model '{spec.name}' is for {'/'.join(spec.tasks)}; '{inputs.dataset}' is "
                          f"a {task} dataset")
    if task == "classification" and len(inputs.target.classes) < 2:
        raise ConfigError(f"data.path: '{inputs.dataset}' has {len(inputs.target.classes)} classes; a classifier "
                          f"needs at least 2")
    _check_model(cfg, spec, inputs)
    _check_builders(cfg, spec)
    _check_backend(cfg, spec, inputs)
    if cfg.data.bucket_by_length and not inputs.features.length_column:
        raise ConfigError(f"data.bucket_by_length: only token data has lengths to group by; '{inputs.dataset}' has "
                          f"{features} features")
    if cfg.data.augment and spec.augment is None:
        having = [name for name, other in MODELS.specs.items() if other.augment is not None]
        raise ConfigError(f"data.augment: model '{spec.name}' has no augmentation (a model spec's `augment`; "
                          f"models with one: {', '.join(having) or 'none'})")
    choice("run", "monitor", cfg.run.monitor, metric_names(task, text=features == "tokens"))
    _check_steps_fit(cfg, manifest_json(cfg.data.path))


def _check_data_reading(data: DictConfig) -> None:
    if data.cache_in_worker not in (True, False, "auto"):
        raise ConfigError(f"data.cache_in_worker: must be true, false or auto, got {data.cache_in_worker!r}")
    if data.cache_max_bytes < 0:
        raise ConfigError(f"data.cache_max_bytes: must be >= 0, got {data.cache_max_bytes}")
    if data.shuffle_buffer < 1:
        raise ConfigError(f"data.shuffle_buffer: must be >= 1 (rows), got {data.shuffle_buffer}")


def _check_recipe(cfg: DictConfig) -> None:
    """The recipe keys every backend shares (contract/recipe.py) and how the best epoch is picked."""
    trainer, run = cfg.trainer, cfg.run
    choice("trainer", "optimizer", trainer.optimizer, recipe.OPTIMIZERS)
    choice("trainer", "lr_schedule", trainer.lr_schedule, recipe.LR_SCHEDULES)
    choice("trainer", "precision", trainer.precision, recipe.PRECISIONS)
    if trainer.weight_decay < 0:
        raise ConfigError(f"trainer.weight_decay: must be >= 0, got {trainer.weight_decay}")
    if trainer.weight_decay > 0 and trainer.optimizer != "adamw":
        # PyTorch's adam/sgd add decay to the gradient (L2), Keras' decouple it: only adamw means the same in both.
        raise ConfigError(f"trainer.weight_decay: only adamw decays weights (decoupled, the same in every "
                          f"framework); got optimizer={trainer.optimizer}")
    if not 0 <= trainer.momentum < 1:
        raise ConfigError(f"trainer.momentum: must be in [0, 1), got {trainer.momentum}")
    if trainer.warmup_steps < 0:
        raise ConfigError(f"trainer.warmup_steps: must be >= 0, got {trainer.warmup_steps}")
    if not 0 <= trainer.warmup_fraction < 1:
        raise ConfigError(f"trainer.warmup_fraction: must be in [0, 1), got {trainer.warmup_fraction}")
    if trainer.warmup_steps and trainer.warmup_fraction:
        raise ConfigError("trainer.warmup_fraction: set warmup_steps or warmup_fraction, not both")
    if trainer.grad_clip is not None and trainer.grad_clip <= 0:
        raise ConfigError(f"trainer.grad_clip: must be > 0 (null: no clipping), got {trainer.grad_clip}")
    if trainer.precision == "fp16" and not trainer.use_gpu:
        raise ConfigError("trainer.precision: fp16 needs GPUs (loss scaling, fast half kernels); on CPU use bf16")
    if run.monitor_mode is not None:
        choice("run", "monitor_mode", run.monitor_mode, recipe.MONITOR_MODES)
    choice("run", "final_model", run.final_model, recipe.FINAL_MODELS)
    choice("run", "progress", run.progress, PROGRESS_SETTINGS)
    if run.patience is not None and run.patience < 1:
        raise ConfigError(f"run.patience: must be >= 1 (null: no early stopping), got {run.patience}")
    if trainer.profile_steps < 0:
        raise ConfigError(f"trainer.profile_steps: must be >= 0 (0: off), got {trainer.profile_steps}")
    name = run.register_model
    if name is not None and (not name.strip() or "/" in name or ":" in name):
        raise ConfigError(f"run.register_model: '{name}' is not a model name MLflow accepts (not blank, no / or :)")


def _check_steps_fit(cfg: DictConfig, manifest: dict) -> None:
    """Every data-parallel rank trains at least one batch an epoch, and warmup ends before the run does. A rank
    holds rows // ranks of the train split; a pipeline (pp > 1) trains full batches only (its stages need fixed
    shapes: the epoch's short last batch is left out), and so do the TensorFlow backends; the PyTorch backends keep
    the short batch. tf_ps' epoch is the train split's full batches, whichever workers take them."""
    trainer = cfg.trainer
    rows = manifest.get("splits", {}).get("train", {}).get("rows")
    if not isinstance(rows, int):
        return
    layout = layout_of(trainer)
    ranks, full = layout.epoch_ranks, layout.full_batches
    per_rank = rows // ranks
    steps = per_rank // trainer.batch_size if full else -(-per_rank // trainer.batch_size)
    if steps == 0:
        raise ConfigError(f"trainer.batch_size: each of the {ranks} data-parallel rank(s) holds {per_rank} of the "
                          f"{rows} training rows{full}: a batch of {trainer.batch_size} leaves it nothing to train")
    if trainer.max_steps_per_epoch:
        steps = min(steps, trainer.max_steps_per_epoch)
    warmup, updates = recipe.schedule_steps(trainer, steps)
    if warmup and warmup >= updates:
        key = "warmup_steps" if trainer.warmup_steps else "warmup_fraction"
        raise ConfigError(f"trainer.{key}: {warmup} warmup steps is not shorter than the run ({updates} optimizer "
                          f"steps: {trainer.epochs} epochs of {steps} batches, grad_accum={trainer.grad_accum})")


def _check_refs(spec: ModelSpec) -> None:
    """Each `"module:attribute"` the spec names: a module that can be found, holding the attribute where the
    module is loaded already (a user's plugin module naming its own builders); found, not imported, so that
    validation stays framework-free. A misspelt one would otherwise fail only on the workers."""
    for field in ("torch", "keras", "dtensor", "lightning", "keras_twin", "tensor_parallel", "pipeline_split",
                  "fsdp_blocks", "check", "flops_per_sample", "augment", "export"):
        ref = getattr(spec, field)
        if not isinstance(ref, str):
            continue
        module, _, attribute = ref.partition(":")
        where = f"model.name: model '{spec.name}' names {field}={ref!r}"
        if not module or not attribute:
            raise ConfigError(f"{where}: not a \"module:attribute\" reference")
        if not installed(module):
            raise ConfigError(f"{where}: no module '{module}' on the path")
        if module in sys.modules and not hasattr(sys.modules[module], attribute):
            raise ConfigError(f"{where}: module '{module}' has no '{attribute}'")


def _check_model(cfg: DictConfig, spec: ModelSpec, inputs: DataSchema | None) -> None:
    """The spec's references, and its own checks of its keys (with the data once known: `inputs`)."""
    _check_refs(spec)
    if spec.check is not None:
        with keyed_errors("model.name"):
            resolve(spec.check)(cfg.model, inputs, cfg.trainer)


def _check_backend(cfg: DictConfig, model: ModelSpec, inputs: DataSchema | None) -> None:
    """The backend's own checks (its spec's `check`: its keys, its layout, what it needs of the model and the
    data once known), and the `fault.*` testing hooks it takes."""
    spec = BACKENDS.get(cfg.trainer.backend)
    for key in sorted({key for other in BACKENDS.specs.values() for key in other.fault_keys}):
        if cfg.fault[key] and key not in spec.fault_keys:
            owners = [name for name, other in BACKENDS.specs.items() if key in other.fault_keys]
            raise ConfigError(f"fault.{key}: only trainer={', '.join(owners)} runs servers to kill")
    if spec.check is not None:
        with keyed_errors("trainer.backend"):
            resolve(spec.check)(cfg, model, inputs)


def _check_builders(cfg: DictConfig, spec: ModelSpec) -> None:
    """The model's spec has a builder the backend builds it with (names the missing spec field)."""
    builders = model_builders(cfg.trainer)
    if not any(getattr(spec, name) is not None for name in builders):
        offered = [name for name in BUILDER_FIELDS if getattr(spec, name) is not None]
        wanted = " or ".join(BUILDER_FIELDS[name] for name in builders)
        raise ConfigError(f"model.name: trainer={cfg.trainer.backend} builds the model with {wanted}; "
                          f"model '{spec.name}' has none (it has: {', '.join(offered) or 'no builder'})")


@contextlib.contextmanager
def keyed_errors(key: str) -> Iterator[None]:
    """A spec's check (a user's, perhaps) raising ValueError: ConfigError in one line, starting with the key its
    message names, else `key`."""
    try:
        yield
    except ValueError as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        keyed = re.match(r"(model|trainer|data|run|fault)\.[\w.]+: ", message)
        raise ConfigError(message if keyed else f"{key}: {message}") from err


def _check_installed(trainer: DictConfig) -> None:
    """The backend's framework can be imported here (found, not imported: validation stays framework-free)."""
    spec = BACKENDS.get(trainer.backend)
    framework = trainer.framework if len(spec.frameworks) > 1 else spec.frameworks[0]
    if framework not in FRAMEWORKS:
        return  # an unknown `trainer.framework`: its own check names the choices
    modules, extra = FRAMEWORKS[framework]
    missing = [module for module in modules if not installed(module)]
    if not missing:
        modules, extra = spec.needs, spec.extra
        missing = [module for module in modules if not installed(module)]
    if missing:
        raise ConfigError(f"trainer.backend: {trainer.backend} needs {', '.join(missing)}, not installed in this "
                          f"environment: pip install 'ray-train-pipelines[{extra}]'")
