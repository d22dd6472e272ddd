"""The checks of each backend's own keys and layouts (pipelines/checks.py runs them): the PyTorch layouts (tp,
fsdp, pipeline stages, torch.compile), the TensorFlow strategies, DTensor meshes, the parameter-server cluster, and
Horovod; and what a backend needs of the model's spec (`check_builders`). Framework-free: the facts they need
(schedules, mesh arithmetic) come from modules that import no framework; a model's own sizes are its spec's
`check`."""
from __future__ import annotations

import re

from omegaconf import DictConfig

from contract.data import DataSchema
from contract.registry import ModelSpec
from pipelines.errors import ConfigError, choice, installed
from trainers import framework_of, model_builders

BUILDER_FIELDS = {"torch": "a PyTorch builder (torch=)", "keras": "a Keras builder (keras=)",
                  "dtensor": "a DTensor module builder (dtensor=)",
                  "lightning": "a LightningModule builder (lightning=)"}
LIGHTNING_STRATEGIES = ("ddp", "fsdp")
ZERO_STAGES = (1, 2, 3)
TF_LOOPS = ("fit", "custom")
TF_COMMUNICATIONS = ("auto", "ring", "nccl")
TF_STRATEGIES = ("mirrored", "central_storage")
TF_CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
HOROVOD_FRAMEWORKS = ("torch", "tf")
HOROVOD_COMPRESSIONS = ("none", "fp16")

def check_parallelism(cfg: DictConfig) -> None:
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


def check_builders(cfg: DictConfig, spec: ModelSpec, inputs: DataSchema) -> None:
    """The model's spec has what the backend builds it with, and the plans its layout needs: a tensor-parallel
    plan for tp > 1, a pipeline split for pp > 1 (names the missing spec field)."""
    trainer = cfg.trainer
    builders = model_builders(trainer)
    builder = next((name for name in builders if getattr(spec, name) is not None), None)
    if builder is None:
        offered = [name for name in BUILDER_FIELDS if getattr(spec, name) is not None]
        wanted = " or ".join(BUILDER_FIELDS[name] for name in builders)
        raise ConfigError(f"model.name: trainer={trainer.backend} builds the model with {wanted}; "
                          f"model '{spec.name}' has none (it has: {', '.join(offered) or 'no builder'})")
    if trainer.get("tp", 1) > 1 and spec.tensor_parallel is None:
        raise ConfigError(f"trainer.tp: tp={trainer.tp} shards the model by its spec's tensor-parallel plan; model "
                          f"'{spec.name}' has none (tensor_parallel=, e.g. trainers.torch.parallel.plans.styles_plan)")
    if trainer.backend == "tp" and spec.tensor_parallel is None:  # it applies the plan at any degree, tp=1 too
        raise ConfigError(f"trainer.backend: trainer=tp lays the model out by its spec's tensor-parallel plan; model "
                          f"'{spec.name}' has none (data parallelism alone: trainer=ddp or trainer=fsdp)")
    if trainer.get("pp", 1) > 1 and spec.pipeline_split is None:
        raise ConfigError(f"trainer.pp: pp={trainer.pp} splits the model into stages by its spec's pipeline_split; "
                          f"model '{spec.name}' has none (pipeline_split=, e.g. "
                          f"trainers.torch.parallel.pipeline.sequential_split)")
    if builder == "dtensor" and spec.keras_twin is None and spec.keras is None:
        raise ConfigError(f"model.name: tf_dtensor logs the trained model as a Keras twin; model '{spec.name}' has "
                          f"none (keras_twin=, or keras=)")
    if builder == "dtensor" and inputs.target.task != "classification":
        raise ConfigError(f"trainer.backend: tf_dtensor trains classifiers only; '{inputs.dataset}' is a "
                          f"{inputs.target.task} dataset")
    if trainer.backend == "tf_ps" and trainer.tf_loop == "fit" and inputs.features.kind == "tokens":
        raise ConfigError("trainer.tf_loop: tf_ps trains token data with the custom loop only (it counts each "
                          "step's tokens); use tf_loop=custom")


# The recipe's optimizer keys (contract/recipe.py): a model spec's own LightningModule builds its optimizer and
# schedule in its `configure_optimizers`, so under trainer=lightning these change nothing.
OPTIMIZER_KEYS = ("trainer.optimizer", "trainer.lr", "trainer.weight_decay", "trainer.momentum", "trainer.lr_schedule",
                  "trainer.warmup_steps", "trainer.warmup_fraction")


def ignored_keys(cfg: DictConfig, spec: ModelSpec) -> tuple[tuple[str, ...], str]:
    """The training keys this backend and model do not read, and why: a sweep over one would train the same
    trial several times (pipelines/sweep/space.py `reject_ignored`)."""
    if cfg.trainer.backend == "lightning" and spec.lightning is not None:
        return OPTIMIZER_KEYS, (f"model '{spec.name}' is its own LightningModule, whose configure_optimizers picks "
                                f"its optimizer and schedule; sweep the keys of its model config that it reads")
    return (), ""


def check_lightning(cfg: DictConfig) -> None:
    """Lightning's strategies: its FSDP refuses CPUs ("The strategy `fsdp` requires a GPU accelerator")."""
    trainer = cfg.trainer
    if trainer.backend != "lightning":
        return
    choice("trainer", "strategy", trainer.strategy, LIGHTNING_STRATEGIES)
    if trainer.strategy == "fsdp" and not trainer.use_gpu:
        raise ConfigError("trainer.strategy: Lightning's fsdp strategy runs on GPUs only (use_gpu=true); on CPUs use "
                          "strategy=ddp, or trainer=fsdp")
    if trainer.strategy == "fsdp" and trainer.grad_clip is not None:
        raise ConfigError("trainer.grad_clip: Lightning's fsdp strategy does not clip by the global norm "
                          "(\"gradient_clip_algorithm='norm' is currently not supported for FSDPPrecision\"); "
                          "use strategy=ddp, or trainer=fsdp")
    if trainer.strategy == "fsdp" and trainer.precision == "fp16":
        raise ConfigError("trainer.precision: fp16 (loss scaling over sharded gradients) is not supported with fsdp; "
                          "use bf16")


def check_deepspeed(cfg: DictConfig) -> None:
    """The ZeRO stage, and the user's DeepSpeed JSON against the recipe (trainers/torch/deepspeed_config.py)."""
    from trainers.torch.deepspeed_config import DeepSpeedConfigError, engine_config

    trainer = cfg.trainer
    if trainer.backend != "deepspeed":
        return
    if trainer.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"trainer.zero_stage: must be one of {ZERO_STAGES}, got {trainer.zero_stage}")
    try:
        engine_config(trainer)
    except DeepSpeedConfigError as err:
        raise ConfigError(str(err)) from err


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
    from trainers.torch.parallel.schedules import SCHEDULES

    choice("trainer", "pp_schedule", trainer.pp_schedule, SCHEDULES)
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


def check_tensorflow(cfg: DictConfig) -> None:
    trainer = cfg.trainer
    if trainer.backend != "tf_mwms":
        return
    if trainer.tf_loop not in TF_LOOPS:
        raise ConfigError(f"trainer.tf_loop: unknown '{trainer.tf_loop}' (choices: {TF_LOOPS})")
    if trainer.tf_communication not in TF_COMMUNICATIONS:
        raise ConfigError(f"trainer.tf_communication: unknown '{trainer.tf_communication}' "
                          f"(choices: {TF_COMMUNICATIONS})")
    if trainer.devices_per_worker > 1 and trainer.num_workers > 1 and not trainer.use_gpu:
        raise ConfigError("trainer.devices_per_worker: several CPU replicas per worker need num_workers=1 "
                          "(MirroredStrategy in one process); with several workers each worker has one CPU replica")
    if trainer.tf_communication == "nccl" and not trainer.use_gpu:
        raise ConfigError("trainer.tf_communication: nccl needs GPUs; set trainer.use_gpu=true or use ring/auto")
    choice("trainer", "tf_strategy", trainer.tf_strategy, TF_STRATEGIES)
    choice("trainer", "tf_cross_device_ops", trainer.tf_cross_device_ops, TF_CROSS_DEVICE_OPS)
    if trainer.tf_strategy == "central_storage" and trainer.num_workers > 1:
        raise ConfigError("trainer.tf_strategy: central_storage keeps the variables on one machine: num_workers=1 "
                          "(several devices: trainer.devices_per_worker)")
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
        if trainer.num_workers > 1 or trainer.devices_per_worker == 1 or trainer.tf_strategy != "mirrored":
            raise ConfigError("trainer.tf_cross_device_ops: how MirroredStrategy sums over one worker's devices: "
                              "needs num_workers=1, devices_per_worker > 1, tf_strategy=mirrored (workers: "
                              "trainer.tf_communication)")
        if trainer.tf_cross_device_ops == "nccl" and not trainer.use_gpu:
            raise ConfigError("trainer.tf_cross_device_ops: nccl needs GPUs; on CPUs use hierarchical_copy or "
                              "reduce_to_one")


def check_dtensor(cfg: DictConfig) -> None:
    """The mesh fits the workers' devices; the recipe it has. (Whether the mesh splits the model's layers evenly is
    the model spec's `check`: trainers/models/specs.py.)"""
    from trainers.tf.dtensor.layout import MeshDims

    trainer = cfg.trainer
    if trainer.backend != "tf_dtensor":
        return
    if min(trainer.mesh.batch, trainer.mesh.model) < 1:
        raise ConfigError(f"trainer.mesh: batch and model must be >= 1, got {dict(trainer.mesh)}")
    dims = MeshDims(trainer.mesh.batch, trainer.mesh.model, trainer.num_workers, trainer.devices_per_worker)
    if dims.problem():
        raise ConfigError(f"trainer.mesh: {dims.problem()}")
    _require_fp32_without_accumulation(trainer, "")


def _require_fp32_without_accumulation(trainer: DictConfig, why: str) -> None:
    for key, fine in (("grad_accum", trainer.grad_accum == 1), ("precision", trainer.precision == "fp32")):
        if not fine:
            raise ConfigError(f"trainer.{key}: {trainer.backend} trains with grad_accum=1 and precision=fp32 only{why}")


def check_tf_ps(cfg: DictConfig) -> None:
    """ParameterServerStrategy's options, and the fault injection that kills one of its servers."""
    trainer, fault = cfg.trainer, cfg.fault
    if trainer.backend != "tf_ps":
        if fault.kill_servers:
            raise ConfigError("fault.kill_servers: only trainer=tf_ps runs servers to kill")
        return
    choice("trainer", "tf_loop", trainer.tf_loop, TF_LOOPS)
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


def check_compile(trainer: DictConfig) -> None:
    """torch.compile wraps the training forward of the PyTorch backends; a pipeline schedule runs its stages itself."""
    if not trainer.compile:
        return
    if framework_of(trainer) == "tf":
        raise ConfigError("trainer.compile: torch.compile is for the PyTorch backends (TensorFlow compiles its "
                          "training step with tf.function already)")
    if trainer.backend == "fsdp" and trainer.pp > 1:
        raise ConfigError("trainer.compile: not supported with pipeline stages (pp > 1)")
    if trainer.backend == "deepspeed":
        raise ConfigError("trainer.compile: not supported with deepspeed (its engine wraps the model)")
    if trainer.backend == "lightning":
        raise ConfigError("trainer.compile: not supported with lightning (its Trainer runs the LightningModule "
                          "it is given); compile inside your LightningModule instead")


def check_horovod(cfg: DictConfig) -> None:
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
    if not installed("horovod"):
        raise ConfigError("trainer.backend: horovod is not installed; build it with "
                          "`bash cluster/local/build-horovod.sh`")
