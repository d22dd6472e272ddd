"""Memory against dataset size: one epoch of the same `rtp train` run (ddp, an MLP, streamed or held data) on
generated tables of 1x, 2x and 4x the rows, and the memory each took.

    python -m benchmarks.memory_vs_size [--rows 1440000] [--features 256] [--scales 1,2,4] [--workers 2]
                                        [--cache-in-worker false] [--data-dir /tmp/rtp-memory-vs-size]

Each table is `rtp prepare synthetic --rows <rows x scale> --features <features>` (1x: 1.44M rows of 256 float32
features, about 1.5 GB of Parquet), kept in `--data-dir` for the next run. While the run trains (on a Ray of its
own, one thread per worker), the machine's used memory and its shared memory (where Ray's object store lives) are
sampled twice a second; printed per scale: the peak of each above the machine's use before the run, the workers'
peak RSS (the run's `peak_memory_bytes`, the largest rank's) and global samples/s. The last line, `growth=`, is
the peak used memory at the largest scale over that at the smallest.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from benchmarks.common import QUIET_ENV, ROOT, pipeline_run

GB = 1e9


def prepared(rows: int, features: int, folder: Path) -> Path:
    """The generated table of `rows` rows, written once."""
    if not (folder / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "pipelines.prepare", "synthetic", "--rows", str(rows), "--features",
               str(features), "--out", str(folder)]
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, **QUIET_ENV}, check=True, capture_output=True)
    return folder


class Peaks:
    """The machine's used and shared memory, sampled every `every` seconds until `stop`."""

    def __init__(self, every: float = 0.5):
        self.used = self.shared = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, args=(every,), daemon=True)

    def _sample(self, every: float) -> None:
        while not self.done.wait(every):
            memory = psutil.virtual_memory()
            self.used, self.shared = max(self.used, memory.used), max(self.shared, memory.shared)

    def __enter__(self) -> Peaks:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_440_000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--scales", default="1,2,4")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-in-worker", default="false")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/rtp-memory-vs-size"))
    parser.add_argument("--set", nargs="*", default=[], help="more pipelines.train overrides")
    args = parser.parse_args()
    peaks_used = []
    for scale in [int(s) for s in args.scales.split(",")]:
        rows = args.rows * scale
        data = prepared(rows, args.features, args.data_dir / f"x{scale}")
        on_disk = sum(p.stat().st_size for p in data.glob("*.parquet"))
        before = psutil.virtual_memory()
        with Peaks() as peaks:
            history, last = pipeline_run([
                "trainer=ddp", "model=mlp", "data=synthetic", f"data.path={data}", "trainer.epochs=1",
                f"trainer.num_workers={args.workers}", f"data.cache_in_worker={args.cache_in_worker}",
                "trainer.batch_size=512", "run.system_metrics=false", *args.set])
        used, shared = (peaks.used - before.used) / GB, (peaks.shared - before.shared) / GB
        peaks_used.append(used)
        print(f"{scale}x: {rows:,} rows, {on_disk / GB:.2f} GB of Parquet: used memory +{used:.2f} GB, shared "
              f"(object store) +{shared:.2f} GB, worker peak RSS {last['peak_memory_bytes'] / GB:.2f} GB, "
              f"{history['samples_per_s'][-1]:,.0f} samples/s", flush=True)
    print(f"growth={peaks_used[-1] / peaks_used[0]:.3f}")


if __name__ == "__main__":
    main()
