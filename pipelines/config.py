"""Config: Hydra composes `conf/`, the typed schemas of contract/config.py (one trainer schema per backend) and
the checks here validate it, before Ray or MLflow is touched.

Every error is a `ConfigError` whose message starts with the offending key; the CLI prints it on one
line and exits with code 2.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contract import recipe
from contract.checkpoint import STATE_FILE
from contract.config import MODEL_SCHEMAS, TRAINER_SCHEMAS, parallel_degrees, schema, worker_resources
from contract.metrics import metric_names
from contract.progress import PROGRESS_SETTINGS

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """Invalid configuration; the message names the key."""


DATA_MODELS = {"mnist": ("mlp", "cnn"), "imdb": ("bert", "embed_pool", "tfidf")}  # which models fit which data
KERAS_MODELS = ("mlp", "cnn", "embed_pool")  # trainers/models/keras_models.py
DTENSOR_MODELS = ("mlp", "tfidf")  # trainers/models/tf_modules.py
TF_LOOPS = ("fit", "custom")
TF_COMMUNICATIONS = ("auto", "ring", "nccl")
TF_STRATEGIES = ("mirrored", "central_storage")
TF_CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
HOROVOD_FRAMEWORKS = ("torch", "tf")
HOROVOD_COMPRESSIONS = ("none", "fp16")
POSITIVE = ("num_workers", "threads_per_worker", "batch_size", "lr", "epochs", "tf_steps_per_execution",
            "tf_devices", "grad_accum", "devices_per_worker", "num_ps",
            "ps_min_shard_bytes")  # trainer keys, where the backend has them


def _schema_for(cfg: DictConfig) -> DictConfig:
    """The typed schema of the backend and model the composed config names: a key of another backend's schema
    is then an unknown key."""
    backend = OmegaConf.select(cfg, "trainer.backend")
    if backend not in TRAINER_SCHEMAS:
        raise ConfigError(f"trainer.backend: unknown backend '{backend}' (choices: {sorted(TRAINER_SCHEMAS)})")
    model_name = OmegaConf.select(cfg, "model.name")
    if model_name not in MODEL_SCHEMAS:
        raise ConfigError(f"model.name: unknown model '{model_name}' (choices: {sorted(MODEL_SCHEMAS)})")
    return schema(backend, model_name)


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="config", overrides=overrides)
    except HydraException as err:
        first_line = str(err).strip().splitlines()[0]
        unknown = re.fullmatch(r"Could not override '([\w.]+)'\.", first_line)
        if unknown:
            raise ConfigError(f"{unknown[1]}: not a key of this config{_did_you_mean(unknown[1])} (each backend has "
                              f"its own trainer keys: conf/trainer/<backend>.yaml)") from err
        raise ConfigError(f"overrides: {first_line}") from err


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


def _check_values(cfg: DictConfig) -> None:
    for key in POSITIVE:
        if key in cfg.trainer and cfg.trainer[key] <= 0:
            raise ConfigError(f"trainer.{key}: must be > 0, got {cfg.trainer[key]}")
    if cfg.trainer.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"trainer.placement_strategy: unknown strategy '{cfg.trainer.placement_strategy}' "
                          f"(choices: {PLACEMENT_STRATEGIES})")
    if cfg.data.name not in DATA_MODELS:
        raise ConfigError(f"data.name: unknown dataset '{cfg.data.name}' (choices: {sorted(DATA_MODELS)})")
    if cfg.model.name not in DATA_MODELS[cfg.data.name]:
        raise ConfigError(f"model.name: model '{cfg.model.name}' does not fit data '{cfg.data.name}' "
                          f"(choices: {DATA_MODELS[cfg.data.name]})")
    _check_model(cfg.model)
    _check_buckets(cfg.data)
    _check_recipe(cfg)
    _check_parallelism(cfg)
    _check_tensorflow(cfg)
    _check_dtensor(cfg)
    _check_tf_ps(cfg)
    _check_horovod(cfg)
    _check_compile(cfg.trainer)
    if cfg.fault.max_failures < 0:
        raise ConfigError(f"fault.max_failures: must be >= 0, got {cfg.fault.max_failures}")
    if cfg.fault.resource_timeout_s < 0:
        raise ConfigError(f"fault.resource_timeout_s: must be >= 0 (0: wait forever), "
                          f"got {cfg.fault.resource_timeout_s}")
    if cfg.run.system_metrics_interval_s < 1:  # a request per sample per process: more would flood the server
        raise ConfigError(f"run.system_metrics_interval_s: must be >= 1, got {cfg.run.system_metrics_interval_s}")
    for key in ("dropout", "attention_dropout"):
        if key in cfg.model and not 0 <= cfg.model[key] < 1:
            raise ConfigError(f"model.{key}: must be in [0, 1), got {cfg.model[key]}")
    if cfg.run.resume_from and not (Path(cfg.run.resume_from) / STATE_FILE).is_file():
        raise ConfigError(f"run.resume_from: no checkpoint at '{cfg.run.resume_from}' (missing {STATE_FILE})")
    manifest = Path(cfg.data.path) / "manifest.json"
    if not manifest.is_file():
        raise ConfigError(f"data.path: no prepared dataset at '{cfg.data.path}' (missing manifest.json); "
                          f"run `python -m pipelines.prepare {cfg.data.name} --out {cfg.data.path}`")
    _check_steps_fit(cfg, _manifest_json(manifest))


def _manifest_json(path: Path) -> dict:
    """The manifest as JSON, or {} when it is not (the data checks before training name what is wrong)."""
    import json

    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _choice(section: str, key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{key}: unknown '{value}' (choices: {', '.join(map(str, choices))})")


def _check_buckets(data: DictConfig) -> None:
    if data.bucket_by_length and data.name != "imdb":
        raise ConfigError(f"data.bucket_by_length: only token data has lengths to group by; '{data.name}' has none")
    if data.bucket_by_length and not data.cache_in_worker:
        raise ConfigError("data.bucket_by_length: grouping an epoch by length needs its rows in memory "
                          "(data.cache_in_worker=true), or set data.bucket_by_length=false to stream")


def _check_recipe(cfg: DictConfig) -> None:
    """The recipe keys every backend shares (contract/recipe.py) and how the best epoch is picked."""
    trainer, run = cfg.trainer, cfg.run
    _choice("trainer", "optimizer", trainer.optimizer, recipe.OPTIMIZERS)
    _choice("trainer", "lr_schedule", trainer.lr_schedule, recipe.LR_SCHEDULES)
    _choice("trainer", "precision", trainer.precision, recipe.PRECISIONS)
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
    scheduled = trainer.lr_schedule != "constant" or trainer.warmup_steps > 0 or trainer.warmup_fraction > 0
    torch_backend = trainer.backend in ("ddp", "tp", "fsdp") or trainer.get("framework") == "torch"
    if scheduled and not cfg.data.cache_in_worker and torch_backend:
        raise ConfigError("trainer.lr_schedule: a schedule needs the epoch's length, known only with "
                          "data.cache_in_worker=true (PyTorch backends stream otherwise)")
    _choice("run", "monitor", run.monitor, metric_names(text=cfg.data.name == "imdb"))
    if run.monitor_mode is not None:
        _choice("run", "monitor_mode", run.monitor_mode, recipe.MONITOR_MODES)
    _choice("run", "final_model", run.final_model, recipe.FINAL_MODELS)
    _choice("run", "progress", run.progress, PROGRESS_SETTINGS)
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
    dp, _ = parallel_degrees(trainer)
    ranks = 1 if trainer.backend == "tf_ps" else dp or trainer.num_workers
    per_rank = rows // ranks
    if trainer.backend == "fsdp" and trainer.pp > 1:
        full = ", and a pipeline trains full batches only"
    elif trainer.backend in ("tf_mwms", "tf_dtensor", "tf_ps") or trainer.get("framework") == "tf":
        full = ", and TensorFlow trains full batches only"
    else:
        full = ""
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


def _check_parallelism(cfg: DictConfig) -> None:
    """Impossible layouts fail here, before any worker starts."""
    trainer = cfg.trainer
    if trainer.max_steps_per_epoch is not None and trainer.max_steps_per_epoch < 1:
        raise ConfigError(f"trainer.max_steps_per_epoch: must be >= 1, got {trainer.max_steps_per_epoch}")
    if trainer.backend == "fsdp":
        _check_fsdp(trainer)
        if trainer.tp == 1 and trainer.pp == 1:
            return
    elif trainer.backend == "tp":
        _check_tp_dp(trainer)
    else:
        return
    if cfg.model.name != "bert":
        kind = "tensor" if trainer.tp > 1 else "pipeline"
        raise ConfigError(f"model.name: {kind} parallelism needs the bert model, got '{cfg.model.name}'")
    from trainers.models.bert import BERT_FLAVOURS

    layers, hidden, heads = BERT_FLAVOURS[cfg.model.flavour]
    layers, hidden, heads = cfg.model.layers or layers, cfg.model.hidden or hidden, cfg.model.heads or heads
    if trainer.get("pp", 1) > 1:
        from trainers.parallel.pipeline import stages_per_rank

        stages = trainer.pp * stages_per_rank(trainer.pp_schedule)
        if layers % stages:
            raise ConfigError(f"trainer.pp: {layers} layers do not split into {stages} equal pipeline stages "
                              f"(pp={trainer.pp}, schedule {trainer.pp_schedule})")
    if heads % trainer.tp:
        raise ConfigError(f"trainer.tp: tp={trainer.tp} does not divide the model's heads={heads}")
    if hidden % heads:
        raise ConfigError(f"model.hidden: hidden={hidden} is not a multiple of heads={heads}")


def _check_tp_dp(trainer: DictConfig) -> None:
    if trainer.tp < 1 or (trainer.dp is not None and trainer.dp < 1):
        raise ConfigError(f"trainer.tp: tp and dp must be >= 1, got tp={trainer.tp} dp={trainer.dp}")
    if trainer.num_workers % trainer.tp:
        raise ConfigError(f"trainer.tp: tp={trainer.tp} does not divide num_workers={trainer.num_workers}")
    dp = trainer.dp if trainer.dp is not None else trainer.num_workers // trainer.tp
    if dp * trainer.tp != trainer.num_workers:
        raise ConfigError(f"trainer.dp: tp*dp={trainer.tp}*{dp}={trainer.tp * dp} != num_workers={trainer.num_workers}")
    if trainer.tp_impl not in ("megatron", "dtensor"):
        raise ConfigError(f"trainer.tp_impl: unknown '{trainer.tp_impl}' (choices: megatron, dtensor)")


def _check_fsdp(trainer: DictConfig) -> None:
    """num_workers = dp_replicate x dp_shard x pp x tp."""
    if trainer.pp < 1 or trainer.num_workers % trainer.pp:
        raise ConfigError(f"trainer.pp: must be >= 1 and divide num_workers={trainer.num_workers}, got {trainer.pp}")
    if trainer.tp < 1 or (trainer.num_workers // trainer.pp) % trainer.tp:
        raise ConfigError(f"trainer.tp: must be >= 1 and divide num_workers / pp = {trainer.num_workers // trainer.pp}"
                          f", got {trainer.tp}")
    dp = trainer.num_workers // (trainer.tp * trainer.pp)
    if trainer.dp_replicate < 1 or dp % trainer.dp_replicate:
        raise ConfigError(f"trainer.dp_replicate: must be >= 1 and divide num_workers / (pp x tp) = {dp}, got "
                          f"{trainer.dp_replicate}")
    if trainer.dp_shard is not None and trainer.dp_replicate * trainer.dp_shard != dp:
        raise ConfigError(f"trainer.dp_shard: dp_replicate x dp_shard x pp x tp = {trainer.dp_replicate} x "
                          f"{trainer.dp_shard} x {trainer.pp} x {trainer.tp} != num_workers={trainer.num_workers}")
    if trainer.precision == "fp16":
        raise ConfigError("trainer.precision: fp16 (loss scaling over sharded gradients) is not supported with fsdp; "
                          "use bf16")
    if trainer.pp > 1:
        _check_pipeline(trainer)


def _check_pipeline(trainer: DictConfig) -> None:
    from trainers.parallel.pipeline import SCHEDULES

    _choice("trainer", "pp_schedule", trainer.pp_schedule, SCHEDULES)
    if trainer.microbatches < trainer.pp:
        raise ConfigError(f"trainer.microbatches: {trainer.microbatches} micro-batches leave stages of a {trainer.pp}-"
                          f"stage pipeline idle; use >= pp")
    if trainer.batch_size % trainer.microbatches:
        raise ConfigError(f"trainer.microbatches: {trainer.microbatches} does not divide batch_size="
                          f"{trainer.batch_size}")
    if trainer.pp_schedule == "interleaved_1f1b" and trainer.microbatches % trainer.pp:
        raise ConfigError(f"trainer.microbatches: interleaved_1f1b needs a multiple of pp={trainer.pp}, got "
                          f"{trainer.microbatches}")
    if trainer.grad_accum != 1:
        raise ConfigError("trainer.grad_accum: with pp > 1 the micro-batches are the accumulation; use "
                          "trainer.microbatches")


def _check_tensorflow(cfg: DictConfig) -> None:
    trainer = cfg.trainer
    if trainer.backend != "tf_mwms":
        return
    if trainer.tf_loop not in TF_LOOPS:
        raise ConfigError(f"trainer.tf_loop: unknown '{trainer.tf_loop}' (choices: {TF_LOOPS})")
    if trainer.tf_communication not in TF_COMMUNICATIONS:
        raise ConfigError(f"trainer.tf_communication: unknown '{trainer.tf_communication}' "
                          f"(choices: {TF_COMMUNICATIONS})")
    if trainer.tf_devices > 1 and trainer.num_workers > 1 and not trainer.use_gpu:
        raise ConfigError("trainer.tf_devices: several CPU replicas per worker need num_workers=1 "
                          "(MirroredStrategy in one process); with several workers each worker has one CPU replica")
    if trainer.tf_communication == "nccl" and not trainer.use_gpu:
        raise ConfigError("trainer.tf_communication: nccl needs GPUs; set trainer.use_gpu=true or use ring/auto")
    _choice("trainer", "tf_strategy", trainer.tf_strategy, TF_STRATEGIES)
    _choice("trainer", "tf_cross_device_ops", trainer.tf_cross_device_ops, TF_CROSS_DEVICE_OPS)
    if trainer.tf_strategy == "central_storage" and trainer.num_workers > 1:
        raise ConfigError("trainer.tf_strategy: central_storage keeps the variables on one machine: num_workers=1 "
                          "(several devices: trainer.tf_devices)")
    if trainer.tf_strategy == "central_storage" and trainer.grad_accum > 1:
        raise ConfigError("trainer.grad_accum: under CentralStorageStrategy our accumulators become one variable "
                          "summing the replicas' shares, which the optimizer sums again (measured: twice the "
                          "gradient); use tf_strategy=mirrored")
    scheduled = trainer.lr_schedule != "constant" or trainer.warmup_steps or trainer.warmup_fraction
    if trainer.tf_strategy == "central_storage" and scheduled:
        raise ConfigError("trainer.lr_schedule: tf-keras 2.21 fails to update a learning-rate schedule under "
                          "CentralStorageStrategy (an AggregatingVariable updated in a replica context); use a "
                          "constant rate there, or tf_strategy=mirrored")
    if trainer.tf_cross_device_ops != "auto":
        if trainer.num_workers > 1 or trainer.tf_devices == 1 or trainer.tf_strategy != "mirrored":
            raise ConfigError("trainer.tf_cross_device_ops: how MirroredStrategy sums over one worker's devices: "
                              "needs num_workers=1, tf_devices > 1, tf_strategy=mirrored (workers: "
                              "trainer.tf_communication)")
        if trainer.tf_cross_device_ops == "nccl" and not trainer.use_gpu:
            raise ConfigError("trainer.tf_cross_device_ops: nccl needs GPUs; on CPUs use hierarchical_copy or "
                              "reduce_to_one")
    if cfg.model.name not in KERAS_MODELS:
        raise ConfigError(f"model.name: backend tf_mwms has Keras models for {', '.join(KERAS_MODELS)} only, "
                          f"got '{cfg.model.name}'")


def _check_dtensor(cfg: DictConfig) -> None:
    """The mesh fits the workers' devices and splits every sharded weight evenly; the models and recipe it has."""
    from trainers.parallel.dtensor_layout import MeshDims, sharded_widths

    trainer, model = cfg.trainer, cfg.model
    if trainer.backend != "tf_dtensor":
        if model.name == "tfidf":
            raise ConfigError("model.name: the tfidf model is trained by trainer=tf_dtensor only")
        return
    if model.name not in DTENSOR_MODELS:
        raise ConfigError(f"model.name: tf_dtensor has {', '.join(DTENSOR_MODELS)} models only, got '{model.name}'")
    if min(trainer.mesh.batch, trainer.mesh.model) < 1:
        raise ConfigError(f"trainer.mesh: batch and model must be >= 1, got {dict(trainer.mesh)}")
    dims = MeshDims(trainer.mesh.batch, trainer.mesh.model, trainer.num_workers, trainer.devices_per_worker)
    if dims.problem():
        raise ConfigError(f"trainer.mesh: {dims.problem()}")
    # Layer widths, inputs first (the input width is never split: the TF-IDF model's is the vocabulary's, 0 here)
    widths = sharded_widths([784, *model.hidden, 10] if model.name == "mlp" else [0, model.hidden, 2])
    uneven = [w for w in widths if w % dims.model]
    if uneven:
        raise ConfigError(f"trainer.mesh.model: {dims.model} devices do not split the sharded layer widths {uneven} "
                          f"evenly (model.hidden)")
    _require_fp32_without_accumulation(trainer, "")


def _require_fp32_without_accumulation(trainer: DictConfig, why: str) -> None:
    for key, fine in (("grad_accum", trainer.grad_accum == 1), ("precision", trainer.precision == "fp32")):
        if not fine:
            raise ConfigError(f"trainer.{key}: {trainer.backend} trains with grad_accum=1 and precision=fp32 only{why}")


def _check_tf_ps(cfg: DictConfig) -> None:
    """ParameterServerStrategy's options, and the fault injection that kills one of its servers."""
    trainer, fault = cfg.trainer, cfg.fault
    if trainer.backend != "tf_ps":
        if fault.kill_servers:
            raise ConfigError("fault.kill_servers: only trainer=tf_ps runs servers to kill")
        return
    _choice("trainer", "tf_loop", trainer.tf_loop, TF_LOOPS)
    if cfg.model.name not in KERAS_MODELS:
        raise ConfigError(f"model.name: tf_ps has Keras models for {', '.join(KERAS_MODELS)} only, "
                          f"got '{cfg.model.name}'")
    if trainer.tf_loop == "fit" and cfg.data.name != "mnist":
        raise ConfigError("trainer.tf_loop: tf_ps trains text with the custom loop only (it counts each step's "
                          "tokens); use tf_loop=custom")
    if trainer.tf_loop == "fit":  # tf-keras has no batch-level callbacks under ParameterServerStrategy
        for key, wanted in (("trainer.log_every_n_steps", trainer.log_every_n_steps > 0),
                            ("trainer.profile_steps", trainer.profile_steps > 0),
                            ("run.progress", cfg.run.progress == "on")):
            if wanted:
                raise ConfigError(f"{key}: Keras fit under ParameterServerStrategy calls no batch-level callbacks "
                                  f"(step losses, profiling, the step bar); use trainer.tf_loop=custom")
    if trainer.use_gpu:
        raise ConfigError("trainer.use_gpu: tf_ps runs on CPUs (Ray gives its chief and parameter servers the "
                          "workers' resources: each would hold a GPU)")
    _require_fp32_without_accumulation(trainer, " (each worker applies its own gradients as it goes)")
    for item in fault.kill_servers:
        match = re.fullmatch(r"(chief|worker|ps):(\d+)@(\d+)", item)
        count = {"chief": 1, "worker": trainer.num_workers, "ps": trainer.num_ps}[match[1]] if match else 0
        if not match or int(match[2]) >= count or not 1 <= int(match[3]) <= trainer.epochs:
            raise ConfigError(f"fault.kill_servers: expected worker:<i>@<epoch> (i < {trainer.num_workers}), "
                              f"ps:<i>@<epoch> (i < {trainer.num_ps}) or chief:0@<epoch>, epoch "
                              f"1..{trainer.epochs}; got '{item}'")
    tasks = [item.split("@")[0] for item in fault.kill_servers]
    if len(set(tasks)) < len(tasks):
        raise ConfigError(f"fault.kill_servers: each server (or the chief) at most once, got "
                          f"{list(fault.kill_servers)}")
    if fault.kill_servers and (not fault.inject_marker or fault.inject_at_epoch is not None):
        raise ConfigError("fault.kill_servers: needs fault.inject_marker (which kills fired) and no "
                          "fault.inject_at_epoch (one injection at a time)")
    if fault.kill_servers and trainer.tf_loop == "fit":
        raise ConfigError("fault.kill_servers: fires halfway through an epoch, which Keras fit under "
                          "ParameterServerStrategy has no hook for; use trainer.tf_loop=custom")


def _check_compile(trainer: DictConfig) -> None:
    """torch.compile wraps the training forward of the PyTorch backends; a pipeline schedule runs its stages itself."""
    if not trainer.compile:
        return
    tensorflow = trainer.backend in ("tf_mwms", "tf_dtensor", "tf_ps")
    if tensorflow or (trainer.backend == "horovod" and trainer.framework == "tf"):
        raise ConfigError("trainer.compile: torch.compile is for the PyTorch backends (TensorFlow compiles its "
                          "training step with tf.function already)")
    if trainer.backend == "fsdp" and trainer.pp > 1:
        raise ConfigError("trainer.compile: not supported with pipeline stages (pp > 1)")


def _check_horovod(cfg: DictConfig) -> None:
    """Horovod's options, and that it is installed (it is built from source, not part of requirements.lock)."""
    trainer = cfg.trainer
    if trainer.backend != "horovod":
        return
    if trainer.framework not in HOROVOD_FRAMEWORKS:
        raise ConfigError(f"trainer.framework: unknown '{trainer.framework}' (choices: {HOROVOD_FRAMEWORKS})")
    if trainer.compression not in HOROVOD_COMPRESSIONS:
        raise ConfigError(f"trainer.compression: unknown '{trainer.compression}' (choices: {HOROVOD_COMPRESSIONS})")
    if trainer.use_gpu:
        raise ConfigError("trainer.use_gpu: our horovod build has Gloo CPU operations only (no NCCL)")
    if trainer.framework == "tf" and cfg.model.name not in KERAS_MODELS:
        raise ConfigError(f"model.name: horovod with framework=tf has Keras models for {', '.join(KERAS_MODELS)} "
                          f"only, got '{cfg.model.name}'")
    import importlib.util

    if importlib.util.find_spec("horovod") is None:  # finds the package without importing it
        raise ConfigError("trainer.backend: horovod is not installed; build it with "
                          "`bash cluster/local/build-horovod.sh`")


def _check_model(model: DictConfig) -> None:
    if model.name == "cnn" and len(model.channels) != 2:
        raise ConfigError(f"model.channels: the CNN has 2 conv blocks, got {list(model.channels)}")
    if model.name in ("mlp", "cnn"):
        sizes = list(model.hidden) if model.name == "mlp" else [model.hidden, *model.channels]
        if any(size <= 0 for size in sizes):
            raise ConfigError(f"model.hidden: layer sizes must be > 0, got {sizes}")
    if model.name == "tfidf" and model.hidden <= 0:
        raise ConfigError(f"model.hidden: must be > 0, got {model.hidden}")
    if model.name == "tfidf" and model.bigram_buckets < 0:
        raise ConfigError(f"model.bigram_buckets: must be >= 0 (0: no token pairs), got {model.bigram_buckets}")
    if model.name == "embed_pool" and min(model.embed_dim, model.hidden) <= 0:
        raise ConfigError(f"model.embed_dim: sizes must be > 0, got embed_dim={model.embed_dim} hidden={model.hidden}")
    if model.name == "bert":
        from trainers.models.bert import BERT_FLAVOURS

        if model.flavour not in BERT_FLAVOURS:
            raise ConfigError(f"model.flavour: unknown flavour '{model.flavour}' (choices: {sorted(BERT_FLAVOURS)})")
        for key in ("hidden", "layers", "heads"):
            if model[key] is not None and model[key] <= 0:
                raise ConfigError(f"model.{key}: must be > 0, got {model[key]}")


def _absolutise_paths(cfg: DictConfig) -> None:
    # The job may run from a copy of the repo (ray job --working-dir): pin paths to where they were given.
    cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    cfg.run.storage_path = str(Path(cfg.run.storage_path).expanduser().resolve())
    for key in ("dump_params_dir", "resume_dir", "resume_from"):
        if cfg.run[key]:
            cfg.run[key] = str(Path(cfg.run[key]).expanduser().resolve())


def load_config(overrides: list[str]) -> DictConfig:
    """Compose `conf/` with Hydra-style overrides and validate; returns a resolved, read-only config."""
    raw = _compose(overrides)
    try:
        cfg = OmegaConf.merge(_schema_for(raw), raw)
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        message = str(err).strip().splitlines()[0]
        raise ConfigError(f"{key}: {message}") from err
    _check_values(cfg)
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
