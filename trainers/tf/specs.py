"""The TensorFlow backends, registered by name exactly as a user's backend is (contract/registry.py): each one's
config keys (`trainer.*`), its checks, its layout, and its `Backend` object by "module:attribute" (imported only when
a run uses it). Framework-free: checking a config imports no TensorFlow."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from contract.checks import ConfigError, choice
from contract.config import TrainerConfig
from contract.data import DataSchema
from contract.registry import BackendSpec, Layout, ModelSpec, register_backend
from trainers.tf.dtensor.layout import MeshDims

FULL_BATCHES = ", and TensorFlow trains full batches only"  # a Keras epoch is `rows // batch` batches
TF_LOOPS = ("fit", "custom")
TF_COMMUNICATIONS = ("auto", "ring", "nccl")
TF_STRATEGIES = ("mirrored", "central_storage")
TF_CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")


@dataclass
class TFMWMSConfig(TrainerConfig):
    backend: str = "tf_mwms"            # TensorFlow MultiWorkerMirroredStrategy
    tf_loop: str = "fit"                # fit (tf-keras model.fit) | custom (strategy.run loop)
    tf_communication: str = "auto"      # collectives: auto | ring | nccl (nccl needs use_gpu)
    tf_steps_per_execution: int = 8     # optimizer steps per compiled call (fit and custom)
    devices_per_worker: int = 1         # replicas per worker: its GPUs, or logical CPU devices (one worker only)
    tf_strategy: str = "mirrored"       # one worker, several devices: mirrored | central_storage (variables on the CPU)
    tf_cross_device_ops: str = "auto"   # mirrored, one worker: auto | nccl | hierarchical_copy | reduce_to_one


@dataclass
class DTensorMeshConfig:
    batch: int = 2                      # devices along the batch dimension (data parallelism)
    model: int = 1                      # devices along the model dimension (weights sharded)


@dataclass
class TFDTensorConfig(TrainerConfig):
    backend: str = "tf_dtensor"         # TensorFlow DTensor on a batch x model mesh
    mesh: DTensorMeshConfig = field(default_factory=DTensorMeshConfig)  # batch x model = all workers' devices
    devices_per_worker: int = 1         # DTensor devices per worker: GPUs, or logical CPU devices without


@dataclass
class TFPSConfig(TrainerConfig):
    backend: str = "tf_ps"              # TensorFlow ParameterServerStrategy (asynchronous)
    num_ps: int = 1                     # parameter servers (Ray workers beside the chief and the num_workers workers)
    ps_min_shard_bytes: int = 262144    # variables split over the servers in shards of at least this many bytes
    tf_loop: str = "custom"             # custom (ClusterCoordinator.schedule) | fit (tf-keras model.fit)
    tf_steps_per_execution: int = 8     # training steps per scheduled function (each on one worker)


def keras_layout(trainer: Any) -> Layout:
    """One replica per worker, training full batches."""
    return Layout(dp=trainer.num_workers, full_batches=FULL_BATCHES)


def check_fit_checkpoints(cfg: Any) -> None:
    """Keras `fit` runs an epoch in one call: it checkpoints at epoch ends only."""
    if cfg.trainer.tf_loop == "fit":
        for key in ("checkpoint_every_n_steps", "checkpoint_every_s"):
            if cfg.run[key]:
                raise ConfigError(f"run.{key}: Keras fit checkpoints at epoch ends only; use trainer.tf_loop=custom "
                                  f"for checkpoints inside an epoch")


def check_tf_mwms(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    trainer = cfg.trainer
    choice("trainer", "tf_loop", trainer.tf_loop, TF_LOOPS)
    check_fit_checkpoints(cfg)
    choice("trainer", "tf_communication", trainer.tf_communication, TF_COMMUNICATIONS)
    if trainer.devices_per_worker > 1 and trainer.num_workers > 1 and not trainer.use_gpu:
        raise ConfigError("trainer.devices_per_worker: several CPU replicas per worker need num_workers=1 "
                          "(MirroredStrategy in one process); with several workers each worker has one CPU replica")
    if trainer.tf_communication == "nccl" and not trainer.use_gpu:
        raise ConfigError("trainer.tf_communication: nccl needs GPUs; set trainer.use_gpu=true or use ring/auto")
    choice("trainer", "tf_strategy", trainer.tf_strategy, TF_STRATEGIES)
    choice("trainer", "tf_cross_device_ops", trainer.tf_cross_device_ops, TF_CROSS_DEVICE_OPS)
    if trainer.tf_strategy == "central_storage":
        _check_central_storage(trainer)
    if trainer.tf_cross_device_ops != "auto":
        if trainer.num_workers > 1 or trainer.devices_per_worker == 1 or trainer.tf_strategy != "mirrored":
            raise ConfigError("trainer.tf_cross_device_ops: how MirroredStrategy sums over one worker's devices: "
                              "needs num_workers=1, devices_per_worker > 1, tf_strategy=mirrored (workers: "
                              "trainer.tf_communication)")
        if trainer.tf_cross_device_ops == "nccl" and not trainer.use_gpu:
            raise ConfigError("trainer.tf_cross_device_ops: nccl needs GPUs; on CPUs use hierarchical_copy or "
                              "reduce_to_one")


def _check_central_storage(trainer: Any) -> None:
    if trainer.num_workers > 1:
        raise ConfigError("trainer.tf_strategy: central_storage keeps the variables on one machine: num_workers=1 "
                          "(several devices: trainer.devices_per_worker)")
    if trainer.grad_accum > 1:
        raise ConfigError("trainer.grad_accum: under CentralStorageStrategy our accumulators become one variable "
                          "summing the replicas' shares, which the optimizer sums again (twice the gradient); use "
                          "tf_strategy=mirrored")
    if trainer.lr_schedule != "constant" or trainer.warmup_steps or trainer.warmup_fraction:
        raise ConfigError("trainer.lr_schedule: tf-keras 2.21 fails to update a learning-rate schedule under "
                          "CentralStorageStrategy (an AggregatingVariable updated in a replica context); use a "
                          "constant rate there, or tf_strategy=mirrored")


def mesh_dims(trainer: Any) -> MeshDims:
    return MeshDims(trainer.mesh.batch, trainer.mesh.model, trainer.num_workers, trainer.devices_per_worker)


def dtensor_layout(trainer: Any) -> Layout:
    """The mesh's dimensions: its batch dimension is the data-parallel degree, its model dimension the model's."""
    return Layout(dp=trainer.mesh.batch, tp=trainer.mesh.model, full_batches=FULL_BATCHES)


def check_tf_dtensor(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """The mesh fits the workers' devices; the recipe it has; a classifier with a Keras twin to log. (Whether the
    mesh splits the model's layers evenly is the model spec's `check`: trainers/models/specs.py.)"""
    trainer = cfg.trainer
    if min(trainer.mesh.batch, trainer.mesh.model) < 1:
        raise ConfigError(f"trainer.mesh: batch and model must be >= 1, got {dict(trainer.mesh)}")
    if problem := mesh_dims(trainer).problem():
        raise ConfigError(f"trainer.mesh: {problem}")
    _require_fp32_without_accumulation(trainer, "")
    _refuse_augment_and_streaming(cfg)
    if model.dtensor is not None and model.keras_twin is None and model.keras is None:
        raise ConfigError(f"model.name: tf_dtensor logs the trained model as a Keras twin; model '{model.name}' has "
                          f"none (keras_twin=, or keras=)")
    if inputs is not None and inputs.target.task != "classification":
        raise ConfigError(f"trainer.backend: tf_dtensor trains classifiers only; '{inputs.dataset}' is a "
                          f"{inputs.target.task} dataset")


def _refuse_augment_and_streaming(cfg: Any) -> None:
    """tf_dtensor and tf_ps feed their workers from the part each holds (`ShardArrays`), through input pipelines
    of their own: no streamed path, no augmentation. Streaming is refused whether asked for or chosen by `auto`
    for data over `data.cache_max_bytes` (a part that would not fit is refused before it fills a worker's memory)."""
    backend = cfg.trainer.backend
    if cfg.data.augment:
        raise ConfigError(f"data.augment: {backend} feeds its workers from its own input pipeline, which applies "
                          f"no augmentation; use tf_mwms or a PyTorch backend")
    if cfg.data.cache_in_worker is False:
        raise ConfigError(f"data.cache_in_worker: {backend} holds each worker's part of the data in memory and "
                          f"cannot stream it; set data.cache_in_worker=true (or a data.cache_max_bytes above a "
                          f"worker's part) to hold it, or use tf_mwms or a PyTorch backend to stream")


def _require_fp32_without_accumulation(trainer: Any, why: str) -> None:
    for key, fine in (("grad_accum", trainer.grad_accum == 1), ("precision", trainer.precision == "fp32")):
        if not fine:
            raise ConfigError(f"trainer.{key}: {trainer.backend} trains with grad_accum=1 and precision=fp32 only{why}")


def ps_layout(trainer: Any) -> Layout:
    """The chief and the parameter servers are Ray Train workers too; an epoch is the train split's full batches,
    whichever workers take them."""
    return Layout(dp=trainer.num_workers, ray_workers=trainer.num_workers + 1 + trainer.num_ps, epoch_ranks=1,
                  full_batches=FULL_BATCHES)


def check_tf_ps(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """ParameterServerStrategy's options, and the fault injection that kills one of its servers."""
    trainer = cfg.trainer
    choice("trainer", "tf_loop", trainer.tf_loop, TF_LOOPS)
    check_fit_checkpoints(cfg)
    _refuse_augment_and_streaming(cfg)
    if trainer.tf_loop == "fit":  # tf-keras has no batch-level callbacks under ParameterServerStrategy
        for key, wanted in (("trainer.log_every_n_steps", trainer.log_every_n_steps > 0),
                            ("trainer.profile_steps", trainer.profile_steps > 0),
                            ("run.progress", cfg.run.progress == "on")):
            if wanted:
                raise ConfigError(f"{key}: Keras fit under ParameterServerStrategy calls no batch-level callbacks "
                                  f"(step losses, profiling, the step bar); use trainer.tf_loop=custom")
        if inputs is not None and inputs.features.kind == "tokens":
            raise ConfigError("trainer.tf_loop: tf_ps trains token data with the custom loop only (it counts each "
                              "step's tokens); use tf_loop=custom")
    if trainer.use_gpu:
        raise ConfigError("trainer.use_gpu: tf_ps runs on CPUs (Ray gives its chief and parameter servers the "
                          "workers' resources: each would hold a GPU)")
    _require_fp32_without_accumulation(trainer, " (each worker applies its own gradients as it goes)")
    _check_kill_servers(trainer, cfg.fault)


def _check_kill_servers(trainer: Any, fault: Any) -> None:
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


for _spec in (
    BackendSpec("tf_mwms", "trainers.tf.tf_mwms:MWMS", TFMWMSConfig, ("tf",),
                "TensorFlow MultiWorkerMirroredStrategy: tf-keras fit or a custom loop",
                check=check_tf_mwms, layout=keras_layout),
    BackendSpec("tf_dtensor", "trainers.tf.tf_dtensor:DTensor", TFDTensorConfig, ("tf",),
                "TensorFlow DTensor: data, model or 2D parallelism on a batch x model mesh",
                model_builders=("dtensor",), check=check_tf_dtensor, layout=dtensor_layout),
    BackendSpec("tf_ps", "trainers.tf.tf_ps:ParameterServers", TFPSConfig, ("tf",),
                "TensorFlow ParameterServerStrategy: asynchronous data parallelism",
                check=check_tf_ps, layout=ps_layout, fault_keys=("kill_servers",)),
):
    register_backend(_spec)
