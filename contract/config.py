"""The typed config every layer reads: one dataclass schema per section, one trainer schema per backend (the
common keys plus that backend's own, registered with the backend: contract/registry.py), so a key another backend
owns is an error, never silently ignored, and the model's keys from its registered spec.

`pipelines/config.py` composes `conf/` with Hydra and validates values against these; a worker rebuilds the
same typed, read-only config from the plain dict Ray ships to it (`typed_config`), once it has imported the
backend (which registers the built-in specs) and the run's plugins (a user's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from contract.recipe import Monitor, default_mode
from contract.registry import BACKENDS, MODELS, load_plugins


@dataclass
class TrainerConfig:
    """Keys every backend has: the training contract's recipe and resources."""
    backend: str = "ddp"                # the backend (`trainer=<name>` picks it with its keys)
    num_workers: int = 2                # Ray Train workers (the world size)
    threads_per_worker: int = 1         # CPU threads (and Ray CPUs) each worker takes
    use_gpu: bool = False               # a GPU per worker (NCCL for the PyTorch backends)
    batch_size: int = 128               # rows per batch on each data-parallel rank
    lr: float = 1e-3                    # peak learning rate (after warmup)
    optimizer: str = "adam"             # adam | adamw | sgd (contract/recipe.py)
    weight_decay: float = 0.0           # adamw only (decoupled); never on biases and norms
    momentum: float = 0.9               # sgd only
    lr_schedule: str = "constant"       # constant | cosine | linear, stepped per optimizer step
    warmup_steps: int = 0               # optimizer steps of linear warmup
    warmup_fraction: float = 0.0        # or warmup over this fraction of the run's optimizer steps
    grad_clip: Optional[float] = None   # clip the global gradient norm (over all shards) to this
    grad_accum: int = 1                 # batches per optimizer step (gradients averaged over them)
    precision: str = "fp32"             # fp32 | bf16 | fp16 (fp16: GPUs only)
    compile: bool = False               # PyTorch backends: train through torch.compile (not pipelines, not TF)
    epochs: int = 5                     # passes over the training split
    log_every_n_steps: int = 0          # rank 0 logs `step_loss` every n steps (0: off)
    profile_steps: int = 0              # rank 0 profiles n steps after a warmup step: artifact profile/
    max_steps_per_epoch: Optional[int] = None  # cut epochs short (benchmarks, smoke runs)
    placement_strategy: str = "PACK"    # Ray placement of the workers: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD


@dataclass
class DDPConfig(TrainerConfig):
    backend: str = "ddp"                # PyTorch DistributedDataParallel


@dataclass
class TPConfig(TrainerConfig):
    backend: str = "tp"                 # tensor parallelism x data parallelism (PyTorch)
    tp: int = 2                         # tensor-parallel degree
    dp: Optional[int] = None            # data-parallel degree; default num_workers // tp
    tp_impl: str = "megatron"           # megatron | dtensor


@dataclass
class FSDPConfig(TrainerConfig):
    backend: str = "fsdp"               # PyTorch FSDP2 sharded data parallelism (with TP and PP)
    dp_replicate: int = 1               # HSDP: replicas of the sharded model
    dp_shard: Optional[int] = None      # ranks each replica is sharded over; null: what the other degrees leave
    tp: int = 1                         # FSDP x TP: tensor parallelism (DTensor plans) inside, FSDP over the rest
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3); false: keep (ZeRO-2)
    activation_checkpointing: bool = False  # recompute each block's activations in backward instead of keeping them
    pp: int = 1                         # pipeline stages (models with a pipeline_split): over pp groups of tp workers
    pp_schedule: str = "1f1b"           # gpipe | 1f1b | interleaved_1f1b (two stages per worker)
    microbatches: int = 4               # per batch, under pp > 1: >= pp, divides batch_size


@dataclass
class LightningConfig(TrainerConfig):
    backend: str = "lightning"          # PyTorch Lightning's Trainer on Ray Train (ray.train.lightning)
    strategy: str = "ddp"               # ddp | fsdp (Lightning's FSDP needs GPUs: use_gpu=true)


@dataclass
class DeepSpeedConfig(TrainerConfig):
    backend: str = "deepspeed"          # DeepSpeed's engine (ZeRO) on the shared loop
    zero_stage: int = 2                 # ZeRO 1: optimizer states sharded; 2: + gradients; 3: + parameters
    deepspeed_config: Optional[str] = None  # a DeepSpeed JSON of yours, under the recipe's keys (a conflict is an
                                            # error); its optimizer and schedule are the recipe's


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
class HorovodConfig(TrainerConfig):
    backend: str = "horovod"            # Horovod over Gloo
    framework: str = "torch"            # torch (hvd.DistributedOptimizer) | tf (DistributedGradientTape)
    compression: str = "none"           # gradient compression on the wire: none | fp16
    tf_steps_per_execution: int = 8     # framework=tf: optimizer steps per compiled call


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


@dataclass
class PluginsConfig:
    plugins: list[str] = field(default_factory=list)  # modules of yours that register models and data (imported)


@dataclass
class DataConfig:
    name: str = "mnist"             # the dataset (`data=<name>` picks it; a run reads it from its manifest)
    path: str = "data/mnist/parquet"  # its prepared folder (manifest.json and Parquet shards): `rtp prepare`
    eval_split: Optional[str] = None  # the split each epoch's evaluation (test_accuracy, test_mse) is measured on,
                                      # which picks the best epoch; null: validation where the data has one, else test
    cache_in_worker: bool = True    # each worker pulls its shard into memory once (else streams every epoch)
    bucket_by_length: bool = False  # text: batches of similar length, cut to their longest row (contract/data.py)


@dataclass
class RunSection:
    experiment: str = "ray-train-pipelines"  # MLflow experiment
    name: Optional[str] = None        # MLflow run name; default <backend>-<data>-<model>
    seed: int = 0                     # initial weights, shuffles and dropout masks
    storage_path: str = "outputs/ray"  # Ray Train checkpoints and the MLflow spool: shared storage on a cluster
    dump_params_dir: Optional[str] = None  # every rank saves its final parameters here (for checks)
    resume_dir: Optional[str] = None  # stop-and-resume folder (preemption); see contract/resume.py
    resume_from: Optional[str] = None  # a checkpoint folder this run starts from: its weights, optimizer state,
                                       # schedule position and epoch; hyperparameters are this config's (PBT)
    monitor: Optional[str] = None     # the epoch metric that picks the best epoch (contract/recipe.py); default:
                                      # the task's evaluation metric, test_accuracy or test_mse
    monitor_mode: Optional[str] = None  # max | min; default: min for losses and times, else max
    final_model: str = "best"         # the logged MLflow model: the best epoch's, or the last epoch's
    patience: Optional[int] = None    # stop after this many epochs without a better `monitor` (None: never)
    nan_patience: int = 3             # fail the run once this many step losses in a row (those logged every
                                      # trainer.log_every_n_steps), or an epoch's train_loss, are not finite; no
                                      # model is logged, the last finite checkpoint stays
    straggler_ratio: float = 2.0      # warn (and tag the run) when a rank's own time a step, its data wait and
                                      # forward, exceeds the other ranks' median this many times; 0: never
    preflight: Optional[bool] = None  # before the first step: workers reach each other, links measured (preflight.*
                                      # metrics), a node far slower than the rest fails the run; null: on under Slurm
    preflight_timeout_s: float = 30.0  # a worker not reached in this long fails the run at once, naming it
    register_model: Optional[str] = None  # register the logged model as a new version of this registered model
    system_metrics: bool = True       # MLflow system metrics of the driver and rank 0 (contract/tracking/system.py)
    tensorboard: bool = False         # rank 0 also writes TensorBoard event files: the run's tensorboard/ artifacts
    system_metrics_interval_s: float = 10.0  # how often the system metrics are sampled
    progress: str = "auto"            # auto | on | off: Ray Data's bars and each epoch's step bar (auto: in a terminal)
    verbose: bool = False             # Ray's own INFO lines too (worker start, each report, data plans); `-v`


@dataclass
class FaultConfig:
    max_failures: int = 1             # Ray Train restarts the workers from the last checkpoint this often
    resource_timeout_s: float = 600.0  # fail a run whose workers wait longer for the cluster's CPUs/GPUs; 0: wait
    hang_timeout_s: float = 600.0     # no rank advancing this long fails the attempt, stacks in hang/; 0: off
    collective_timeout_s: float = 1800.0  # PyTorch backends: the process group's own timeout of a collective
    inject_at_epoch: Optional[int] = None  # testing: the last rank raises once at this epoch ...
    inject_marker: Optional[str] = None    # ... unless this file exists (created when the failure fires)
    inject_hang_at_step: Optional[int] = None  # testing: the last rank blocks in a collective at this global
                                               # step, once (inject_marker): the hang watchdog's case
    inject_unreachable_rank: Optional[int] = None  # testing: the preflight gives the others an address of this
                                                   # rank that routes nowhere
    kill_servers: list[str] = field(default_factory=list)  # tf_ps: "<worker|ps|chief>:<i>@<epoch>": kill that
                                            # server (fail the chief) halfway through that epoch, once (inject_marker)


def schema(backend: str, model: str) -> DictConfig:
    """The structured config of a run of `backend` training `model` (both registered; RegistryError naming the
    registered ones otherwise). `plugins`: the user modules that register specs (contract/registry.py)."""
    return OmegaConf.create({
        "plugins": OmegaConf.structured(PluginsConfig).plugins,
        "trainer": OmegaConf.structured(BACKENDS.get(backend).config),
        "data": OmegaConf.structured(DataConfig),
        "model": OmegaConf.structured(MODELS.get(model).config),
        "run": OmegaConf.structured(RunSection),
        "fault": OmegaConf.structured(FaultConfig),
    })


def typed_config(plain: dict[str, Any], plugin_roots: Iterable[str] = ()) -> DictConfig:
    """A validated config shipped as plain data (to a Ray worker, a Tune trial), typed and read-only again. Its
    plugins are imported first (a user's model registers its spec), from the working directory (a job's
    `--working-dir`) or the folders the driver found them in (`plugin_roots`: shared storage on Slurm)."""
    load_plugins(plain.get("plugins", []), plugin_roots)
    cfg = OmegaConf.merge(schema(plain["trainer"]["backend"], plain["model"]["name"]), plain)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def monitor_of(run: DictConfig) -> Monitor:
    """The run's `Monitor` (which epoch is best, early stopping); `run.monitor` as the config loader resolved it
    (the task's evaluation metric when not given)."""
    metric = run.monitor or "test_accuracy"
    return Monitor(metric, run.monitor_mode or default_mode(metric), run.patience)


def worker_resources(trainer: DictConfig) -> tuple[int, int]:
    """(CPUs, GPUs) a run's workers take together: a CPU per thread, a GPU per worker (tf_dtensor: per device) when
    `use_gpu`. tf_ps' chief and parameter servers share its workers' CPUs (trainers/tf/tf_ps.py: build_trainer)."""
    gpus = trainer.num_workers * trainer.get("devices_per_worker", 1) if trainer.use_gpu else 0
    return trainer.num_workers * trainer.threads_per_worker, gpus


def ray_train_workers(trainer: DictConfig) -> int:
    """Ray Train workers a run starts: one per worker, and for tf_ps also the chief and the parameter servers."""
    return trainer.num_workers + (1 + trainer.num_ps if trainer.backend == "tf_ps" else 0)


def parallel_degrees(trainer: DictConfig) -> tuple[int, int]:
    """(dp, tp) of any backend: the data-parallel backends are tp=1, dp=num_workers."""
    if trainer.backend == "tp":
        return trainer.dp, trainer.tp
    if trainer.backend == "fsdp":
        return trainer.num_workers // (trainer.tp * trainer.pp), trainer.tp
    if trainer.backend == "tf_dtensor":
        return trainer.mesh.batch, trainer.mesh.model
    return trainer.num_workers, 1
