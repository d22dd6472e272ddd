"""The config reference (docs/config-reference.md), generated from the typed schemas and conf/: every key of a
training run, of each backend and built-in model, of a sweep, and of evaluate and predict, with its default and
its meaning (the comment beside the field in its dataclass). `python -m pipelines.config_reference` prints it;
`--write` writes docs/config-reference.md. The suite fails when the file is not what this prints."""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from pipelines.cli import choice_description
from pipelines.config import compose, group_choices, schema_for
from pipelines.help import default_choices, key_table, nested_schemas, section_schemas

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
SHARED = ("plugins", "data.", "run.", "fault.")

HEADER = """# Config reference

Every key a command takes, with its default and what it does. Generated from the typed schemas
(`contract/config.py`, each backend's and model's config) and `conf/` by `python -m pipelines.config_reference
--write`; a test fails when this page and the code disagree. `rtp config [overrides]` prints the composed config of
a run, and `rtp <command> --help` the keys of the choices on its command line (`rtp config trainer=fsdp --help`).

Keys are set on the command line as `KEY=VALUE` (`trainer.lr=0.01`), groups as `GROUP=CHOICE` (`trainer=fsdp`,
`model=cnn`, `data=imdb`); a model or dataset of yours adds its own choices and keys (`plugins=[your.module]`,
[your-model-and-data.md](your-model-and-data.md)).
"""


def cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | `{cell(value)}` | {cell(meaning)} |" for key, value, meaning in rows]
    return "\n".join(lines)


def training_rows(overrides: list[str]) -> list[tuple[str, str, str]]:
    raw = compose(overrides)
    cfg = OmegaConf.merge(schema_for(raw), raw)
    return key_table(cfg, section_schemas(cfg))


def group_sections(group: str, title: str) -> list[str]:
    """One section per choice of `group`: its own keys (those under `group.`), as that choice composes them."""
    sections = []
    for name in group_choices(group):
        rows = [row for row in training_rows([f"{group}={name}"]) if row[0].startswith(f"{group}.")]
        about = choice_description(group, name)
        sections.append(f"### {title} `{group}={name}`\n\n{about}\n\n{table(rows)}")
    return sections


def dataclass_section(title: str, schema: type, command: str) -> str:
    rows = key_table(OmegaConf.structured(schema), nested_schemas(schema))
    return f"## {title}\n\n`{command}`\n\n{table(rows)}"


def reference() -> str:
    from pipelines.evaluate import EvaluateConfig
    from pipelines.predict import PredictConfig
    from pipelines.sweep.space import SweepConfig

    defaults = ", ".join(f"`{group}={choice}`" for group, choice in default_choices().items())
    shared = [row for row in training_rows([]) if row[0].startswith(SHARED)]
    parts = [HEADER,
             f"## Every training run (`rtp train`, `rtp config`, each sweep trial)\n\nDefaults: {defaults}. "
             f"The `data.*` defaults are those of `data=mnist`; each dataset sets its own `data.path`.\n\n"
             f"{table(shared)}",
             "## Backends (`trainer=...`)\n\nThe keys of each backend, as `trainer=<name>` sets them.",
             *group_sections("trainer", "Backend"),
             "## Built-in models (`model=...`)",
             *group_sections("model", "Model"),
             dataclass_section("Sweeps (`rtp sweep`)", SweepConfig, "rtp sweep [sweep=PRESET] [sweep.KEY=VALUE ...] "
                               "[training KEY=VALUE ...]; each preset (conf/sweep/) sets its own values"),
             dataclass_section("Evaluate (`rtp evaluate`)", EvaluateConfig, "rtp evaluate model=... [KEY=VALUE ...]"),
             dataclass_section("Predict (`rtp predict`)", PredictConfig, "rtp predict model=... [KEY=VALUE ...]")]
    return "\n\n".join(part.strip() for part in parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = reference()
    if "--write" in argv:
        REFERENCE.write_text(text)
        print(f"wrote {REFERENCE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
