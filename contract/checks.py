"""What every check shares: `ConfigError` (its message starts with the offending key; a command prints it on one
line and exits with code 2), a choice among names, whether a package is installed."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Invalid configuration; the message names the key."""


def choice(section: str, key: str, value: Any, choices: tuple) -> None:
    """`section.key` is one of `choices`, else ConfigError naming them."""
    if value not in choices:
        raise ConfigError(f"{section}.{key}: unknown '{value}' (choices: {', '.join(map(str, choices))})")


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it (or a broken parent package)
        return False
