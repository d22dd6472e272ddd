"""`rtp`, the one command line: `rtp <command> [arguments]`, each command one of the pipelines (also run as
`python -m pipelines.<name>`), plus `rtp list` and `rtp config`. Works from any directory. `rtp --help`, `rtp list`
and `rtp config` import no torch, TensorFlow or Ray: they answer at once."""
from __future__ import annotations

import importlib
import sys

from omegaconf import OmegaConf

from pipelines.config import CONF_DIR, ConfigError, group_choices, installed, load_config, load_user_plugins
from contract.registry import DATASETS, MODELS
from pipelines.help import first_comment, training_help, wants_help
from trainers import BACKENDS, FRAMEWORKS

# command -> (its module, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("pipelines.prepare", "raw data -> Parquet shards and a manifest (mnist, imdb, your table)"),
    "train": ("pipelines.train", "train one model on the Ray cluster at RAY_ADDRESS (else a local Ray), into MLflow"),
    "sweep": ("pipelines.sweep.run", "many training runs on Ray Tune (grid, ASHA, PBT) and their scaling report"),
    "evaluate": ("pipelines.evaluate", "score a logged model on a prepared split"),
    "predict": ("pipelines.predict", "score a logged model on raw inputs (images, texts, tables)"),
    "export": ("pipelines.export", "write a logged model in its framework's own format (a Transformers folder)"),
    "replay": ("pipelines.replay", "finish a run or sweep whose MLflow server was away"),
    "report": ("pipelines.sweep.report", "rebuild the scaling report of a sweep from its MLflow runs"),
    "screenshots": ("pipelines.sweep.screenshots", "a sweep in the MLflow UI, as PNG files (headless Chromium)"),
    "list": ("pipelines.cli", "the backends, models, datasets and sweep presets, one line each [plugins=[...]]"),
    "config": ("pipelines.cli", "the composed, validated training config of these overrides (starts nothing)"),
}

# `-v` (or `--verbose`) after a command: Ray's own INFO lines on the console too, as this key says
VERBOSE_KEYS = {"train": "run.verbose=true", "sweep": "run.verbose=true", "evaluate": "verbose=true",
                "predict": "verbose=true"}

USAGE = """usage: rtp <command> [-v] [arguments]

Distributed deep-learning training on Ray (Train, Data, Tune), tracked in MLflow, from a laptop to a Slurm cluster.

commands:
{commands}

`rtp <command> --help` tells a command's arguments, keys and exit codes. `-v` (train, sweep, evaluate, predict):
Ray's own INFO lines too (worker start, each report, data plans), which are otherwise off the console.
Environment: RAY_ADDRESS (a Ray cluster; unset: a local Ray of the command's own), MLFLOW_TRACKING_URI (unset: the
sqlite store mlflow.db of the project).

examples:
  rtp prepare mnist --out data/mnist/parquet
  rtp train trainer=ddp model=cnn trainer.epochs=3
  ray job submit --working-dir . -- rtp train data.path=$PWD/data/mnist/parquet"""

CONFIG_SUMMARY = """Print the training config these overrides compose (conf/ and the typed schemas), checked as
`rtp train` checks it before taking any resource: the YAML and exit 0, or one line and exit 2. Starts nothing."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        commands = "\n".join(f"  {name:<13}{what}" for name, (_, what) in COMMANDS.items())
        print(USAGE.format(commands=commands))
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command '{command}' (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if command == "list":
        return list_choices(args)
    if command == "config":
        return print_config(args)
    return importlib.import_module(COMMANDS[command][0]).main(with_verbose_key(command, args))


def with_verbose_key(command: str, args: list[str]) -> list[str]:
    """`args` with `-v`/`--verbose` as the config key of `command` that it stands for (VERBOSE_KEYS)."""
    if command not in VERBOSE_KEYS or not {"-v", "--verbose"} & set(args):
        return args
    return [arg for arg in args if arg not in ("-v", "--verbose")] + [VERBOSE_KEYS[command]]


def list_choices(overrides: list[str]) -> int:
    """The registered backends (and the extra a missing framework needs), then each config group's choices, with
    the models and datasets of the plugins named (`plugins=[...]`) or installed (entry points)."""
    if wants_help(overrides):
        print(f"usage: rtp list [plugins=[your.module,...]]\n\n{COMMANDS['list'][1]}")
        return 0
    other = [arg for arg in overrides if not arg.startswith("plugins=")]
    if other:
        print(f"error: rtp list: takes plugins=[...] only, got {' '.join(other)}", file=sys.stderr)
        return 2
    try:
        load_user_plugins(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    groups = (("model", "models"), ("data", "datasets"), ("sweep", "sweep presets"))
    width = 2 + max(len(name) for name in [*BACKENDS.names(), *(c for group, _ in groups
                                                                for c in group_choices(group))])
    lines = ["backends (trainer=...):"]
    for name, spec in sorted(BACKENDS.specs.items()):
        missing = [FRAMEWORKS[f][1] for f in spec.frameworks
                   if not all(installed(module) for module in FRAMEWORKS[f][0])]
        missing += [spec.extra] if not all(installed(module) for module in spec.needs) else []
        note = f" [not installed: pip install 'ray-train-pipelines[{','.join(missing)}]']" if missing else ""
        lines.append(f"  {name:<{width}}{spec.description}{note}")
    for group, title in groups:
        lines.append(f"{title} ({group}=...):")
        lines += [f"  {name:<{width}}{choice_description(group, name)}" for name in group_choices(group)]
    print("\n".join(line.rstrip() for line in lines))
    return 0


def choice_description(group: str, name: str) -> str:
    """A group choice's line: its yaml's first comment, else its registered spec's description."""
    path = CONF_DIR / group / f"{name}.yaml"
    if path.is_file():
        return first_comment(path)
    registry = {"trainer": BACKENDS, "model": MODELS, "data": DATASETS}.get(group)
    return registry.get(name).description if registry is not None and name in registry else ""


def print_config(overrides: list[str]) -> int:
    if wants_help(overrides):
        print(training_help("rtp config [GROUP=CHOICE ...] [KEY=VALUE ...]", CONFIG_SUMMARY, overrides,
                            "0 the config is valid (printed as YAML); 2 it is not (one line naming the key)",
                            ["rtp config trainer=fsdp model=cnn", "rtp config trainer=tp trainer.tp=2 data=imdb "
                             "model=bert_tiny data.path=data/imdb/parquet"]))
        return 0
    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(OmegaConf.to_yaml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
