"""The typed config every layer reads: one dataclass schema per section, one trainer schema per backend (the
common keys plus that backend's own, registered with the backend: contract/registry.py), so a key another backend
owns is an error, never silently ignored, and the model's keys from its registered spec.

`pipelines/config.py` composes `conf/` with Hydra and validates values against these; a worker rebuilds the
same typed, read-only config from the plain dict Ray ships to it (`typed_config`), once it has imported the
backend (which registers the built-in specs) and the run's plugins (a user's).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from contract.recipe import Monitor, default_mode
from contract.registry import BACKENDS, MODELS, Layout, load_plugins


@dataclass
class TrainerConfig:
    """Keys every backend has: the training contract's recipe and resources."""
    backend: str = "ddp"                # the backend (`trainer=<name>` picks it with its keys)
    num_workers: int = 2                # Ray Train workers (the world size; an elastic run's most)
    min_workers: int = 0                # elastic: go on with down to this many workers while nodes are lost, and
                                        # grow back to num_workers as they return (0: always num_workers)
    resize_check_s: float = 60.0        # elastic: how often Ray Train looks for room to grow the group
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
class PluginsConfig:
    plugins: list[str] = field(default_factory=list)  # modules of yours that register models and data (imported)


@dataclass
class DataConfig:
    name: str = MISSING             # the dataset (`data=<name>` picks it; a run reads it from its manifest)
    path: str = MISSING             # its prepared folder (manifest.json and Parquet shards): `rtp prepare`
    eval_split: Optional[str] = None  # the split each epoch's evaluation (test_accuracy, test_mse) is measured on,
                                      # which picks the best epoch; null: validation where the data has one, else test
    cache_in_worker: Any = "auto"   # true: each worker holds its shard in memory; false: streamed from the files
                                    # a window at a time; auto: true when a worker's shard is under cache_max_bytes
    cache_max_bytes: int = 2 << 30  # auto caches a worker's shard up to this size (its stored bytes)
    shuffle_buffer: int = 100_000   # streamed: rows of the window each epoch is shuffled within (memory per worker)
    bucket_by_length: bool = False  # text: batches of similar length, cut to their longest row (contract/data.py)
    augment: bool = False           # training batches through the model spec's `augment` (the CNN: random shifts),
                                    # seeded per sample: reproducible, and exact on resume (contract/augment.py)


@dataclass
class RunSection:
    experiment: str = "ray-train-pipelines"  # MLflow experiment
    name: Optional[str] = None        # MLflow run name; default <backend>-<data>-<model>
    seed: int = 0                     # initial weights, shuffles and dropout masks
    storage_path: str = "${oc.env:PIPELINE_STORAGE_PATH,outputs/ray}"  # Ray Train checkpoints and the MLflow
                                      # spool: shared storage on a cluster (cluster/slurm sets PIPELINE_STORAGE_PATH)
    dump_params_dir: Optional[str] = None  # every rank saves its final parameters here (for checks)
    resume_dir: Optional[str] = "${oc.env:PIPELINE_RESUME_DIR,null}"  # stop-and-resume folder (preemption):
                                      # contract/resume.py; cluster/slurm sets PIPELINE_RESUME_DIR
    resume_from: Optional[str] = None  # a checkpoint folder this run starts from: its weights, optimizer state,
                                       # schedule position and epoch; hyperparameters are this config's (PBT)
    monitor: Optional[str] = None     # the epoch metric that picks the best epoch (contract/recipe.py); default:
                                      # the task's evaluation metric, test_accuracy or test_mse
    monitor_mode: Optional[str] = None  # max | min; default: min for losses and times, else max
    final_model: str = "best"         # the logged MLflow model: the best epoch's, or the last epoch's
    patience: Optional[int] = None    # stop after this many epochs without a better `monitor` (None: never)
    checkpoint_every_n_steps: int = 0  # a checkpoint inside the epoch every this many steps, which a restarted or
                                       # continued run resumes at that step; 0: at epoch ends only
    checkpoint_every_s: float = 0.0   # or every this many seconds of training (the ranks agree within 10 steps)
    keep_checkpoints: int = 2         # keep the last this many checkpoints, and the best epoch's (`monitor`) too
    nan_patience: int = 3             # fail the run once this many step losses in a row (those logged every
                                      # trainer.log_every_n_steps), or an epoch's train_loss, are not finite; no
                                      # model is logged, the last finite checkpoint stays
    straggler_ratio: float = 2.0      # warn (and tag the run) when a rank's own time a step, its data wait and
                                      # forward, exceeds the other ranks' median this many times; 0: never
    preflight: Optional[bool] = None  # before the first step: workers reach each other, links measured (preflight.*
                                      # metrics), a node far slower than the rest fails the run; null: on under Slurm
    preflight_timeout_s: float = 30.0  # a worker not reached in this long fails the run at once, naming it
    preflight_leave_out: Optional[bool] = None  # a node the preflight finds at fault has its Ray stopped and the
                                      # run starts again without it (unless it is the head's); null: under Slurm
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
    inject_at_step: Optional[int] = None  # testing: the last rank raises once before this global step, after the
                                          # checkpoints reported before are registered (inject_marker)
    inject_kill: bool = False             # testing: the injected failure kills the rank's process (SIGKILL) instead
    inject_hang_at_step: Optional[int] = None  # testing: the last rank blocks in a collective at this global
                                               # step, once (inject_marker): the hang watchdog's case
    inject_unreachable_rank: Optional[int] = None  # testing: the preflight gives the others an address of this
                                                   # rank that routes nowhere
    inject_unreachable_node: Optional[str] = None  # testing: ... of every rank on the node of this IP
    kill_servers: list[str] = field(default_factory=list)  # tf_ps: "<worker|ps|chief>:<i>@<epoch>": kill that
                                            # server (fail the chief) halfway through that epoch, once (inject_marker)


def shared_sections() -> DictConfig:
    """The sections of a run whatever its backend, model and data, with their defaults: the root Hydra composes
    `conf/config.yaml` on (pipelines/config.py)."""
    return OmegaConf.create({"plugins": OmegaConf.structured(PluginsConfig).plugins,
                             "run": OmegaConf.structured(RunSection), "fault": OmegaConf.structured(FaultConfig)})


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


def at_world_size(cfg: DictConfig, world_size: int) -> DictConfig:
    """An elastic run's config (`trainer.min_workers`) for a group of `world_size` workers: the configured global
    batch (`batch_size` x `num_workers` rows) in per-rank batches of global / world_size rows, so that an epoch's
    steps, each step's rows and loss, and the learning-rate schedule are the same at any size."""
    trainer = cfg.trainer
    if world_size == trainer.num_workers:
        return cfg
    sized = OmegaConf.merge(cfg, {"trainer": {"num_workers": world_size,
                                              "batch_size": trainer.batch_size * trainer.num_workers // world_size}})
    OmegaConf.set_readonly(sized, True)
    return sized


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


def layout_of(trainer: DictConfig) -> Layout:
    """How a run of this trainer config spreads over its Ray Train workers (its backend's `layout` rule)."""
    layout = BACKENDS.get(trainer.backend).layout_of(trainer)
    return replace(layout, ray_workers=layout.ray_workers or trainer.num_workers,
                   epoch_ranks=layout.epoch_ranks or layout.dp)
