"""`--help` of the commands, from what the config system knows: the config groups and their choices (conf/), every
key of the chosen groups with its default (as composed) and meaning (the comments of the typed schemas in
contract/config.py), the exit codes and examples. Imports no torch, TensorFlow or Ray: help answers at once."""
from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import is_dataclass
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf

from contract.config import DataConfig, FaultConfig, PluginsConfig, RunSection
from contract.registry import BACKENDS, MODELS
from pipelines.config import CONF_DIR, ConfigError, compose, group_choices, schema_for

HELP_FLAGS = ("-h", "--help")
GROUPS = ("trainer", "data", "model")
WIDTH = 118


def wants_help(argv: list[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` (and of its dataclass bases) and its trailing comment in the source, with the
    comment-only lines that continue it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(klass: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    current = None
    for line in inspect.getsource(klass).splitlines()[1:]:
        field = re.match(r" {4}(\w+): [^#]*?(?:#\s?(.*))?$", line)
        if field:
            current = field[1]
            docs[current] = (field[2] or "").strip()
            continue
        more = re.match(r"\s+#\s?(.*)$", line)
        if more and current is not None:
            docs[current] = f"{docs[current]} {more[1].strip()}".strip()
        else:
            current = None
    return docs


def section_schemas(cfg: DictConfig) -> dict[str, type]:
    """The dataclass behind each section of a composed training config (a backend's nested ones too, e.g.
    `trainer.mesh`)."""
    return {"": PluginsConfig, **nested_schemas(BACKENDS.get(cfg.trainer.backend).config, "trainer"),
            "data": DataConfig, "model": MODELS.get(cfg.model.name).config, "run": RunSection, "fault": FaultConfig}


def key_table(cfg: DictConfig, schemas: dict[str, type]) -> list[tuple[str, str, str]]:
    """(key, default, meaning) of every key of `cfg`; `schemas` maps a section's dotted path ('' for the root) to
    its dataclass."""
    docs = {f"{section}.{name}".lstrip("."): doc for section, cls in schemas.items()
            for name, doc in field_docs(cls).items()}
    rows: list[tuple[str, str, str]] = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and path in schemas:
                walk(value, path)
            else:
                rows.append((path, _shown(value), docs.get(path, "")))
    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return rows


def nested_schemas(cls: type, prefix: str = "") -> dict[str, type]:
    """`cls` and the dataclasses of its fields, by dotted path ('' for `cls`)."""
    found = {prefix: cls}
    for name, hint in get_type_hints(cls).items():
        if is_dataclass(hint):
            found.update(nested_schemas(hint, f"{prefix}.{name}".lstrip(".")))
    return found


def _shown(value: Any) -> str:
    if value == "???":
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("'", "") if isinstance(value, list) else str(value)


def format_rows(rows: list[tuple[str, str, str]]) -> str:
    """Aligned `key  default  meaning` lines, the meaning wrapped under itself."""
    key_w = max(len(key) for key, _, _ in rows) + 2
    value_w = min(max(len(value) for _, value, _ in rows), 24) + 2
    indent = " " * (2 + key_w + value_w)
    lines = []
    for key, value, doc in rows:
        head = f"  {key:<{key_w}}{value:<{value_w}}"
        if len(value) > value_w - 2:  # a long default gets its own lines
            lines += textwrap.wrap(value, WIDTH, initial_indent=f"  {key:<{key_w}}", subsequent_indent=indent)
            head = indent
        wrapped = textwrap.wrap(doc, WIDTH - len(indent)) or [""]
        lines.append(head + wrapped[0])
        lines.extend(indent + more for more in wrapped[1:])
    return "\n".join(line.rstrip() for line in lines)


def exit_codes_text(codes: str) -> str:
    return textwrap.fill("exit codes: " + codes, WIDTH, subsequent_indent="  ")


def default_choices() -> dict[str, str]:
    """The group choices conf/config.yaml starts from."""
    defaults = OmegaConf.load(CONF_DIR / "config.yaml").defaults
    return {group: choice for entry in defaults if isinstance(entry, DictConfig) for group, choice in entry.items()}


def chosen_groups(argv: list[str]) -> dict[str, str]:
    """The group choices of a command line (`trainer=fsdp`), the defaults for the others."""
    chosen = default_choices()
    for arg in argv:
        group, _, choice = arg.partition("=")
        if group in GROUPS and choice:
            chosen[group] = choice
    return chosen


def groups_text(chosen: dict[str, str]) -> str:
    lines = []
    for group in GROUPS:
        names = [f"{name} (default)" if name == default_choices()[group] else name for name in group_choices(group)]
        lines.append(f"  {group:<9}{', '.join(names)}")
    return "\n".join(lines)


def training_help(usage: str, summary: str, argv: list[str], exit_codes: str, examples: list[str]) -> str:
    """Help of a command that takes training overrides (train, config): the groups, then every key of the groups
    chosen in `argv` with its default and meaning."""
    chosen = chosen_groups(argv)
    picked = " ".join(f"{group}={chosen[group]}" for group in GROUPS)
    plugins = [arg for arg in argv if arg.lstrip("+").startswith("plugins=")]  # a user's model's keys too
    try:
        raw = compose([*plugins, *(f"{group}={chosen[group]}" for group in GROUPS)])
        cfg = OmegaConf.merge(schema_for(raw), raw)
        keys = format_rows(key_table(cfg, section_schemas(cfg)))
    except ConfigError as err:
        keys = f"  ({err})"
    return "\n\n".join([
        f"usage: {usage}", summary,
        "config groups (GROUP=CHOICE; `rtp list` says what each is):\n" + groups_text(chosen),
        f"keys of {picked} (KEY=VALUE overrides one; another choice of a group shows its keys: "
        f"`rtp config trainer=fsdp --help`):\n" + keys,
        exit_codes_text(exit_codes),
        "examples:\n" + "\n".join(f"  {example}" for example in examples)])


def dataclass_help(usage: str, summary: str, schema: type, exit_codes: str, examples: list[str]) -> str:
    """Help of a command whose KEY=VALUE arguments are one dataclass's fields (evaluate, predict)."""
    rows = key_table(OmegaConf.structured(schema), nested_schemas(schema))
    return "\n\n".join([f"usage: {usage}", summary, "arguments (KEY=VALUE):\n" + format_rows(rows),
                        exit_codes_text(exit_codes),
                        "examples:\n" + "\n".join(f"  {example}" for example in examples)])


def first_comment(path: Any) -> str:
    """The first line of a config file's leading comment: what the choice is."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return ""
        text = line.lstrip("# ").strip()
        if text and not text.startswith("`"):
            return text
    return ""
