"""Each Ray Train worker's hang watcher (contract/hang.py says what it decides): a daemon thread that publishes this
rank's position, reads the others', and, once no rank has moved for `fault.hang_timeout_s`, writes the verdict,
dumps this process's stacks into the run's `hang/rank<r>.txt` (Python's `faulthandler` for every thread, then
py-spy's native frames where py-spy can attach) and ends the process, which fails the attempt. A watcher that sees
another rank's verdict dumps its own stacks too, and each waits for the others' before ending. Framework-free: a
thread stuck in a collective releases the GIL, so the watcher runs beside it."""
from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from contract.files import write_atomically
from contract.hang import (HANG_DIR, HANG_EXIT_CODE, PROGRESS_DIR, UNWATCHED, HangVerdict, Position, Progress,
                           publish, read_positions)

PY_SPY_TIMEOUT_S = 30.0


class HangWatch:
    """Watches `progress` (this rank's) with the other ranks' positions under `folder` (the run's, shared)."""

    def __init__(self, progress: Progress, folder: Path, rank: int, world_size: int, timeout_s: float, attempt: str):
        self.progress, self.folder, self.rank, self.world_size = progress, folder, rank, world_size
        self.timeout_s, self.attempt = timeout_s, attempt
        self.interval_s = min(max(timeout_s / 10, 0.5), 5.0)
        self.thread = threading.Thread(target=self._watch, name="hang-watch", daemon=True)

    def start(self) -> "HangWatch":
        self.thread.start()
        return self

    def _watch(self) -> None:
        published: Position | None = None
        seen: dict[int, Position] = {}
        changed = time.monotonic()
        while True:
            time.sleep(self.interval_s)
            if self.verdict_file.exists():  # another rank's watcher fired first: dump beside it
                self._fire(None)
            where = self.progress.position()
            if where != published:
                try:
                    publish(self.folder, self.rank, self.attempt, where)
                    published = where
                except OSError:  # shared storage away a moment: the next round publishes it
                    pass
            positions = {**read_positions(self.folder, self.attempt, self.world_size), self.rank: where}
            now = time.monotonic()
            if positions != seen or any(p.phase in UNWATCHED for p in positions.values()):
                seen, changed = positions, now
            elif now - changed >= self.timeout_s:
                self._fire(HangVerdict(now - changed, self.world_size, positions))

    @property
    def verdict_file(self) -> Path:
        return self.folder / HANG_DIR / f"verdict-{self.attempt}.json"

    def dumped_marker(self, rank: int) -> Path:
        return self.folder / PROGRESS_DIR / f"dumped-{self.attempt}-rank{rank}"

    def _fire(self, verdict: HangVerdict | None) -> None:
        """The verdict first (`None`: another rank's, already written), so that every rank's watcher dumps its
        stacks at once; then this rank's stacks; then, once every rank has dumped (or a bound has passed: a
        rank frozen whole never will), the end of this process. Ray Train sees the workers die and restarts the
        attempt; had this process ended at once, the others' would have been killed before their dumps."""
        hang = self.folder / HANG_DIR
        hang.mkdir(parents=True, exist_ok=True)
        if verdict is not None and not self.verdict_file.exists():  # else another rank's came first: it stands
            write_atomically(self.verdict_file, json.dumps(verdict.to_dict()))
            print(verdict.line(), flush=True)
        line = json.loads(self.verdict_file.read_text())["line"]
        with open(hang / f"rank{self.rank}.txt", "w") as out:
            out.write(f"rank {self.rank}, pid {os.getpid()}: {line}\n\nPython stacks (faulthandler):\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
            out.write(native_stacks())
            for dump in self.progress.on_hang:
                try:
                    dump(hang, self.rank)
                except Exception as err:  # the stacks are written; a backend's extra is best effort
                    out.write(f"\n({getattr(dump, '__name__', dump)} failed: {type(err).__name__}: {err})\n")
        write_atomically(self.dumped_marker(self.rank), "")
        deadline = time.monotonic() + 2 * self.interval_s + PY_SPY_TIMEOUT_S
        while time.monotonic() < deadline and not all(self.dumped_marker(r).exists() for r in range(self.world_size)):
            time.sleep(0.2)
        os._exit(HANG_EXIT_CODE)


def native_stacks() -> str:
    """py-spy's dump of this process with native frames, when py-spy is installed and may attach (ptrace)."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if py_spy is None:
        return "\n(py-spy is not installed: no native frames)\n"
    try:
        done = subprocess.run([py_spy, "dump", "--native", "--pid", str(os.getpid())], capture_output=True,
                              text=True, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"\n(py-spy failed: {err})\n"
    return f"\npy-spy dump --native:\n{done.stdout}{done.stderr}"
