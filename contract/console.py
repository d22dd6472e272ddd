"""The one-line messages the pipelines print."""
from __future__ import annotations

import sys


def say(line: str) -> None:
    """One line to stdout, in a Ray Train worker too. Not print(): Ray Train 2.60 replaces it in workers with one
    that, when a library has wrapped sys.stdout (ours are), writes the line and also logs it to stdout: each line
    showed twice in the driver's output."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()
