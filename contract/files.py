"""Small files that several processes share: the hang watchdog's progress and verdicts, the driver's resume records,
the sweep's trial records, the tracking spool."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """A reader, on this node or another, sees the old file or the new one, never a part (a rename within the
    folder). Each write has a partial file of its own, so writers of one file at once (every rank reaching the
    same hang verdict) all succeed; with one partial name shared, one writer's rename could find the partial already
    renamed by the other, and fail."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(partial, path)
