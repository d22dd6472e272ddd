"""Where a run came from: the git commit, library versions, the command line."""
from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from contract.tracking.server import PROJECT_DIR


def git_commit() -> str:
    if os.environ.get("PIPELINE_GIT_COMMIT"):
        return os.environ["PIPELINE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("ray", "torch", "mlflow", "pyarrow", "tensorflow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def command_line() -> tuple[str, str]:
    """(entry point, the command that started this process as one would type it: `rtp train ...`, `python -m
    pipelines.train ...`); a script outside the project keeps its path."""
    script = Path(sys.argv[0]).resolve()
    if script.name == "rtp" and len(sys.argv) > 1:  # the console script (pipelines/cli.py)
        return f"rtp {sys.argv[1]}", shlex.join(["rtp", *sys.argv[1:]])
    try:
        entry = ".".join(script.relative_to(PROJECT_DIR).with_suffix("").parts)
        words = ["python", "-m", entry]
    except ValueError:
        entry, words = sys.argv[0], ["python", sys.argv[0]]
    return entry, shlex.join([*words, *sys.argv[1:]])


def source_tags() -> dict[str, str]:
    """MLflow's own source tags (the UI's "Source" field) and the run's description: the command line."""
    entry, command = command_line()
    return {"mlflow.source.name": entry, "mlflow.source.type": "JOB",
            "mlflow.note.content": f"Started on {socket.gethostname()} with:\n\n    {command}\n"}
