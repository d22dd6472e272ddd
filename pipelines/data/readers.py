"""Ray Data datasets over prepared Parquet shards. The driver reads the manifest and footers, and drives the read of
data its workers cache (`Materializing`)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from contract.progress import progress_wanted
from pipelines.data.shards import read_manifest, shard_paths

T = TypeVar("T")

if TYPE_CHECKING:
    import ray.data


def read_parquet(paths: list[str], progress: str = "auto") -> "ray.data.Dataset":
    """A lazy Ray Data dataset over Parquet files, read by Ray Data's first Parquet datasource
    (`use_datasource_v2=False`): Ray 2.60's default (V2) starts FooterReader actors at every execution, and every
    training run executes both of its splits (the ordered split materialises them): seconds more per run than
    with the footers read in place (benchmarks/README.md, startup). Progress bars (the footer sampling's, and
    those of the executions the dataset starts from this driver) as `progress` says (`run.progress`)."""
    import ray.data

    context = ray.data.DataContext.get_current()  # read_parquet and the new dataset take their settings from it
    context.use_datasource_v2 = False
    context.enable_progress_bars = progress_wanted(progress)
    return ray.data.read_parquet(paths)


def parquet_datasets(data_dir: str | Path, splits: dict[str, str], progress: str = "auto") -> dict:
    """One lazy `ray.data.Dataset` per entry of `splits` ({dataset name for the trainer: split on disk}); they
    carry their context to the actors that run them, progress bars included or not (`progress`: `run.progress`).
    Ray Data's bars are drawn by its split coordinator actor whatever the driver's terminal: in a log they add
    redrawn lines every second."""
    manifest = read_manifest(data_dir)
    return {name: read_parquet(shard_paths(data_dir, manifest, split), progress) for name, split in splits.items()}


class ResourceWait(RuntimeError):
    """The cluster had no room for the work within `fault.resource_timeout_s`."""


def waited_too_long(what: str, timeout_s: float) -> ResourceWait:
    """Its one line: what Ray Data did not do, and the CPUs free now (a plain message, so that the error pickles
    the way out of a sweep's trial)."""
    import ray

    free = f"{ray.available_resources().get('CPU', 0):g} of the cluster's {ray.cluster_resources().get('CPU', 0):g}"
    return ResourceWait(f"Ray Data did not {what} within fault.resource_timeout_s={timeout_s:g} s: its tasks wait "
                        f"for free CPUs ({free} CPUs free now); other jobs hold the rest (0: wait)")


class InThread:
    """`work()` in a helper thread of the driver (a daemon: an interrupted driver does not wait for it); the
    caller waits for it with a bound (`done_within`), then takes its value or its error (`value`)."""

    def __init__(self, work: Callable[[], T], name: str):
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True, name=name)
        self.thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self.outcome["value"] = work()
        except BaseException as err:  # raised again in the caller's thread
            self.outcome["error"] = err

    def done_within(self, timeout_s: float | None) -> bool:
        self.thread.join(None if timeout_s is None else max(timeout_s, 0.0))
        return not self.thread.is_alive()

    def value(self) -> T:
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]


def within(timeout_s: float | None, what: str, work: Callable[[], T]) -> T:
    """`work()` waited for at most `timeout_s` (None: as long as it takes); ResourceWait naming `what` when it
    still runs then: the Ray tasks it waits for (Ray Data's listing of the Parquet files) need CPUs that other jobs
    hold."""
    job = InThread(work, f"within-{what}")
    if not job.done_within(timeout_s):
        raise waited_too_long(what, timeout_s)
    return job.value()


class Materializing:
    """`datasets` being read whole into Ray's object store, in file order, by helper threads of the driver (one per
    dataset, so that their reads overlap too); `result()` waits and gives {name: `MaterializedDataset`}. The ordered
    shard configs (trainers/data_split.py) split materialised datasets without reading anything, so the read overlaps
    what the driver does meanwhile (importing the backend, building its trainer) instead of starting after Ray
    Train's worker group has started (benchmarks/README.md, startup). Ray Data runs the read tasks in Ray
    workers; the threads only drive them. Daemons: an interrupted driver does not wait for them."""

    def __init__(self, datasets: dict):
        self.jobs = {name: InThread(lambda dataset=dataset: self._materialize(dataset), f"materialize-{name}")
                     for name, dataset in datasets.items()}

    @staticmethod
    def _materialize(dataset: "ray.data.Dataset") -> "ray.data.MaterializedDataset":
        dataset.context.execution_options.preserve_order = True  # block order = file order
        return dataset.materialize()

    def result(self, timeout_s: float | None = None) -> dict:
        """Waits at most `timeout_s` (None: as long as it takes); ResourceWait when a read is still under way then:
        Ray Data's read tasks wait for free CPUs as Ray Train's workers do (`fault.resource_timeout_s`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        unread = [name for name, job in self.jobs.items()
                  if not job.done_within(None if deadline is None else deadline - time.monotonic())]
        if unread:
            raise waited_too_long(f"read the {' and '.join(unread)} shards", timeout_s)
        return {name: job.value() for name, job in self.jobs.items()}
