"""Models, datasets and backends, registered by name: the built-in ones (trainers/models/__init__.py,
pipelines/data/__init__.py, trainers/__init__.py) exactly as a user's own are. A user's module registers its specs
when imported: named in the config (`plugins=[my_project.rtp_plugins]`) or by an installed package's entry point
(group `rtp.plugins`); `load_plugins` imports them on the driver and on every Ray worker.

A spec names its code by callable or by "module:attribute" string: a string keeps the framework out of a process
that only validates a config (`rtp config`, Ray Train's controller) until the code is called. Framework-free.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Mapping, TypeVar, Union

from contract.data import FEATURE_KINDS, TASKS

Ref = Union[str, Callable[..., Any]]  # a callable, or "module:attribute" naming one
ENTRY_POINT_GROUP = "rtp.plugins"


class RegistryError(ValueError):
    """An unknown name, or a plugin that cannot be loaded; the message is one line naming it."""


@dataclass(frozen=True)
class ModelSpec:
    """A model: its config keys (`model.*`, a dataclass whose `name` field defaults to the spec's name), the feature
    kinds and tasks it takes, and its builders. Builders get (model config, the data's `contract.data.DataSchema`,
    seed or None) and return a plain model, no parallelism inside:
      `torch`: an `nn.Module` taking the batch's inputs (one float tensor [B, width] for image and numeric
        features; token ids [B, T] and a mask [B, T] of the real ones for tokens, in training and in the logged
        model alike) and returning [B, classes] logits, or [B] or [B, 1] predictions for regression: ddp, fsdp,
        horovod (torch) train any;
      `keras`: (with the `keras` module first) an uncompiled Keras model, the same inputs and outputs:
        tf_mwms, tf_ps, horovod (tf);
      `dtensor`: a `tf.Module` whose `layers()` trainers/tf/dtensor lays out on its mesh (tf_dtensor), logged as
        `keras_twin` (default: the `keras` builder's model) with its weights;
      `lightning`: a `lightning.pytorch.LightningModule` (trainer=lightning; without one, lightning trains the
        `torch` model with this project's recipe): `forward` as the `torch` model's, `training_step((inputs,
        targets), batch_idx)` returning the loss, its own `configure_optimizers`.
    The parallel plans are optional: `tensor_parallel(model, mesh, impl) -> model` shards the model over the
    mesh's "tp" dimension (trainer=tp, fsdp with tp > 1; `trainers.torch.parallel.plans.styles_plan` makes one from
    torch `ParallelStyle`s by module name); `pipeline_split(model, stage, n_stages) -> model` keeps one pipeline
    stage's parts (fsdp with pp > 1); `fsdp_blocks(model) -> classes`: the module classes FSDP shards one by
    one (default: each entry of the model's `nn.ModuleList`s). `check(cfg, inputs, trainer)` raises
    ValueError("model.<key>: why") for a config it cannot build, or a layout of `trainer` it does not split into
    (`inputs` is None when no data is known yet). `flops_per_sample(cfg, inputs)`: the training FLOPs of one
    sample (contract/mfu.py), where the `torch` model cannot be counted on the meta device (trainers/model_flops.py).
    `mutable`: keys of its config that change only how training continues from a checkpoint, never what the
    checkpoint holds (a `lightning` module's own learning rate), which a PBT sweep may mutate (`model.<key>`).
    `augment(columns, keys, schema) -> columns`: a transform of each training batch (numpy; random shifts, crops,
    flips), seeded per sample (contract/augment.py), applied with `data.augment=true`.
    `export(model, out, tokenizer_json) -> None`: writes the trained `torch` model (dense, on the CPU) into the
    folder `out` in its framework's own format, with the tokenizer its token data was made with (JSON text, or
    None): `rtp export`, and a folder logged with the run's model."""
    name: str
    config: type
    description: str = ""
    inputs: tuple[str, ...] = FEATURE_KINDS  # feature kinds it takes (contract/data.py)
    tasks: tuple[str, ...] = TASKS
    torch: Ref | None = None
    keras: Ref | None = None
    dtensor: Ref | None = None
    lightning: Ref | None = None
    keras_twin: Ref | None = None
    tensor_parallel: Ref | None = None
    pipeline_split: Ref | None = None
    fsdp_blocks: Ref | None = None
    check: Ref | None = None
    flops_per_sample: Ref | None = None
    mutable: tuple[str, ...] = ()
    augment: Ref | None = None
    export: Ref | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset `rtp prepare <name>` makes: `add_arguments(parser)` adds its command-line options (argparse),
    `prepare(args) -> manifest` writes its Parquet shards and manifest into `args.out`. `default_path`: where
    `data=<name>` reads it unless `data.path` says otherwise (without one, `data=<name>` is no choice: a run names
    the folder with `data.path`); `data_keys`: the other `data.*` keys `data=<name>` sets (e.g. an evaluation split,
    length buckets for long texts). `old_manifest(manifest) -> DataSchema`: the features and target of a manifest
    of this dataset written before manifests recorded them. `clean_text(text) -> text`: how `prepare` cleans a
    text before tokenising it, which `rtp predict` does to raw texts too (default: none)."""
    name: str
    prepare: Ref
    add_arguments: Ref | None = None
    description: str = ""
    default_path: str = ""
    data_keys: Mapping[str, Any] = field(default_factory=dict)
    old_manifest: Ref | None = None
    clean_text: Ref | None = None


@dataclass(frozen=True)
class Layout:
    """How a run of a backend spreads over its Ray Train workers, read from its `trainer.*` keys: what the driver's
    checks, a run's params (`dp`, `tp`) and the sweeps' scaling report need, without the framework."""
    dp: int                 # data-parallel degree: replicas that train on different rows (the run's `dp` param)
    tp: int = 1             # model-parallel degree (the run's `tp` param)
    ray_workers: int = 0    # Ray Train workers the run starts; 0: `trainer.num_workers`
    epoch_ranks: int = 0    # ranks an epoch's training rows are divided among; 0: `dp`
    full_batches: str = ""  # why each rank trains full batches only ("": an epoch's short last batch is trained)


def data_parallel(trainer: Any) -> Layout:
    """A data-parallel backend's layout: one replica per worker."""
    return Layout(dp=trainer.num_workers)


@dataclass(frozen=True)
class BackendSpec:
    """A backend: its `Backend` object (trainers/backend.py: builds the Ray Train trainer, runs each worker, logs
    the final model), named by "module:attribute" so that validating a config never imports its framework (with
    several `frameworks`, one per framework: {"torch": ..., "tf": ...}, `trainer.framework` picking); its config
    keys (`trainer.*`, a dataclass); the model builders it can build a model spec with, in order of preference
    (`ModelSpec.torch`, `.keras`, `.dtensor`, `.lightning`; default: the framework's, torch for torch, keras for
    tf); the modules it imports beyond its framework's (`needs`, installed by the package extra `extra`).
    Its rules, framework-free:
      `check(cfg, model, inputs)` raises ValueError("trainer.<key>: why") for a config it cannot train (`model`:
        the model's `ModelSpec`; `inputs`: the data's `DataSchema`, None before the data is known);
      `layout(trainer) -> Layout` (default: `data_parallel`);
      `complete(trainer)` fills the keys whose default follows from others (before the config is read-only);
      `ignored_keys(cfg, model) -> (keys, why)`: training keys this backend and model do not read (a sweep over
        one would train the same trial again);
      `fault_keys`: the `fault.*` testing hooks of its own it takes (other backends refuse them);
      `elastic`: a run may change its number of workers (`trainer.min_workers`): its checkpoints load at any
        number and its data is streamed in an order of the global batch alone."""
    name: str
    backend: Ref | dict[str, Ref]
    config: type
    frameworks: tuple[str, ...]
    description: str = ""
    model_builders: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    extra: str = ""
    check: Ref | None = None
    layout: Ref | None = None
    complete: Ref | None = None
    ignored_keys: Ref | None = None
    fault_keys: tuple[str, ...] = ()
    elastic: bool = False

    def layout_of(self, trainer: Any) -> Layout:
        return resolve(self.layout or data_parallel)(trainer)

    def backend_ref(self, framework: str) -> Ref:
        """The `Backend` that trains with `framework` (one of `frameworks`)."""
        return self.backend[framework] if isinstance(self.backend, dict) else self.backend

    def module(self, framework: str) -> str:
        """The module its `Backend` that trains with `framework` lives in."""
        ref = self.backend_ref(framework)
        return ref.partition(":")[0] if isinstance(ref, str) else ref.__module__


S = TypeVar("S")


@dataclass
class Registry(Generic[S]):
    kind: str
    specs: dict[str, S] = field(default_factory=dict)

    def register(self, spec: S) -> S:
        """Add `spec` under its name; a name already taken by another spec is an error (a plugin loaded twice
        registers the same spec again: fine)."""
        name = spec.name  # type: ignore[attr-defined]
        if name in self.specs and self.specs[name] != spec:
            raise RegistryError(f"{self.kind} '{name}' is registered already (by {_origin(self.specs[name])})")
        self.specs[name] = spec
        return spec

    def get(self, name: str) -> S:
        if name not in self.specs:
            raise RegistryError(f"{self.kind} '{name}' is not registered (registered: {', '.join(self.names())}; "
                                f"a model or dataset of your own: plugins=[your.module])")
        return self.specs[name]

    def names(self) -> list[str]:
        return sorted(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self.specs


def _origin(spec: Any) -> str:
    config = getattr(spec, "config", None) or getattr(spec, "prepare", None)
    return getattr(config, "__module__", None) or str(config)


MODELS: Registry[ModelSpec] = Registry("model")
DATASETS: Registry[DatasetSpec] = Registry("dataset")
BACKENDS: Registry[BackendSpec] = Registry("backend")


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a model; RegistryError in one line for a spec no command could use."""
    where = f"model '{spec.name}'"
    if not (dataclasses.is_dataclass(spec.config) and isinstance(spec.config, type)):
        raise RegistryError(f"{where}: config={spec.config!r} is not a dataclass (its fields are the model.* keys)")
    keys = {f.name for f in dataclasses.fields(spec.config)}
    if "name" not in keys:
        raise RegistryError(f"{where}: config {spec.config.__name__} has no `name` field (name: str = "
                            f"\"{spec.name}\")")
    for what, values, choices in (("inputs", spec.inputs, FEATURE_KINDS), ("tasks", spec.tasks, TASKS),
                                  ("mutable", spec.mutable, tuple(sorted(keys - {"name"})))):
        if isinstance(values, str) or any(value not in choices for value in values):
            raise RegistryError(f"{where}: {what}={values!r}; each must be one of {', '.join(choices)}")
    return MODELS.register(spec)


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    return DATASETS.register(spec)


def register_backend(spec: BackendSpec) -> BackendSpec:
    return BACKENDS.register(spec)


def ref_name(ref: Ref) -> str:
    """A spec's reference as a message shows it: "module:attribute"."""
    return ref if isinstance(ref, str) else f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', ref)}"


def resolve(ref: Ref) -> Callable[..., Any]:
    """The callable a spec names."""
    if callable(ref):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def entry_point_plugins() -> list[str]:
    """The modules installed packages name in their `rtp.plugins` entry points."""
    return sorted({entry.value.split(":")[0] for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def load_plugins(modules: Iterable[str], search: Iterable[str] = ()) -> None:
    """Import each plugin module (it registers its specs), from the working directory too, as `python -m` would, and
    from the `search` folders (where the driver found them: `plugin_roots`). RegistryError in one line naming one
    that fails."""
    for folder in [os.getcwd(), *search]:
        if folder not in sys.path:
            sys.path.append(folder)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # the user's module: any failure is theirs to read, in one line
            raise RegistryError(f"plugins: {module} failed to load ({type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''})") from err


def plugin_roots(modules: Iterable[str]) -> list[str]:
    """The folders the loaded plugin modules were imported from (what a worker adds to its path when it does not
    find them there, e.g. a Slurm node reading the same shared folder)."""
    roots = []
    for module in modules:
        loaded = sys.modules.get(module)
        path = getattr(loaded, "__file__", None)
        if path:
            root = os.path.dirname(os.path.abspath(path))
            for _ in range(module.count(".") + (path.endswith("__init__.py"))):
                root = os.path.dirname(root)
            roots.append(root)
    return sorted(set(roots))
