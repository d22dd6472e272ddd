"""Run a backend's worker in-process on the shared loop (no Ray cluster, no MLflow server): a `WorkerContext`
whose report keeps checkpoints in a folder and whose logger records what rank 0 would log. Used by the loop
tests in this process, in gloo rank pools (tests/support/dist_utils.py) and in subprocesses (TensorFlow and
Horovod want a fresh process). Real checkpoints (`ray.train.Checkpoint` over a local folder), real state files.

Parity (`check_stop_resume_parity`): one uninterrupted run; a run that finds STOP (stops at step 10 of epoch
1); the resumed run from its checkpoint. The resumed curve must be the uninterrupted one, step for step.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from contract.metrics import FIRST_EPOCH_METRICS, STOP_METRICS, metric_names
from trainers.callbacks.base import LoopCallback
from trainers.callbacks.step_times import StepTimes
from trainers.context import NoMetrics, WorkerContext

STOP_AT = 10  # contract.resume.STOP_CHECK_EVERY: the first step at which the ranks agree on STOP


@dataclass
class Recorder:
    """A `MetricsSink` that keeps what rank 0 logs."""
    epochs: dict[int, dict[str, float]] = field(default_factory=dict)
    extras: dict[int, dict[str, float]] = field(default_factory=dict)
    step_losses: dict[int, float] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    artifacts: list[tuple[str, str]] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)

    def log(self, epoch: int, metrics: dict[str, float]) -> None:
        self.epochs.setdefault(epoch, dict(metrics))  # idempotent per epoch, as contract.tracking.EpochLogger

    def log_extra(self, epoch: int, metrics: dict[str, float]) -> None:
        self.extras.setdefault(epoch, {}).update(metrics)

    def log_step_loss(self, step: int, loss: float) -> None:
        assert step not in self.step_losses, f"step {step} logged twice"
        self.step_losses[step] = loss

    def flush(self) -> None:
        pass

    def resumed_from(self, epoch: int, steps: int = 0) -> None:
        self.resumed.append(epoch)

    def log_artifacts(self, folder: str, path: str) -> None:
        self.artifacts.append((folder, path))

    def tag(self, key: str, value: str) -> None:
        self.tags[key] = value

    def append_tag(self, key: str, value: str) -> None:
        self.tags[key] = f"{self.tags[key]},{value}" if key in self.tags else value

    def curve(self) -> np.ndarray:
        steps = sorted(self.step_losses)
        assert steps == list(range(1, len(steps) + 1)), steps
        return np.array([self.step_losses[s] for s in steps])


@dataclass
class Attempt:
    finished: bool
    recorder: Recorder
    reports: list[dict[str, float]]
    checkpoint: Path | None  # the last reported checkpoint folder


def attempt_to_json(attempt: Attempt) -> dict[str, Any]:
    r = attempt.recorder
    return {"finished": attempt.finished, "reports": attempt.reports,
            "checkpoint": str(attempt.checkpoint) if attempt.checkpoint else None,
            "recorder": {"epochs": r.epochs, "extras": r.extras, "step_losses": r.step_losses, "resumed": r.resumed}}


def attempt_from_json(raw: dict[str, Any]) -> Attempt:
    r = raw["recorder"]
    recorder = Recorder(epochs={int(k): v for k, v in r["epochs"].items()},
                        extras={int(k): v for k, v in r["extras"].items()},
                        step_losses={int(k): v for k, v in r["step_losses"].items()}, resumed=r["resumed"])
    return Attempt(raw["finished"], recorder, raw["reports"], Path(raw["checkpoint"]) if raw["checkpoint"] else None)


def make_context(rank: int, world_size: int, epochs: int, folder: Path, recorder: Recorder | None,
                 reports: list, restored: Path | None = None, stop_file: Path | None = None,
                 log_every_n_steps: int = 1) -> WorkerContext:
    """A context whose report copies the reported checkpoint folders (rank 0's; every rank's parts of a sharded
    one, merged as Ray Train merges them) to `folder/checkpoint_<n>`."""
    from ray.train import Checkpoint

    def report(metrics: dict[str, float], directory: str | None, background: bool = False,
               written: Callable[[], Any] | None = None) -> None:
        reports.append(dict(metrics))
        if written is not None:  # the adapter still writes the folder (a save in the background)
            written()
        if directory is not None:
            shutil.copytree(directory, folder / f"checkpoint_{len(reports)}", dirs_exist_ok=True)
            if background:  # the folder is the report's to remove once written, as Ray Train's upload does
                shutil.rmtree(directory)
        _wait_for_every_rank()

    return WorkerContext(rank=rank, world_size=world_size, report=report, epochs=epochs,
                         restored=Checkpoint.from_directory(str(restored)) if restored else None,
                         logger=recorder if rank == 0 and recorder is not None else NoMetrics(), stop_file=stop_file,
                         log_every_n_steps=log_every_n_steps, callbacks=[StepTimes()])


def with_callbacks(ctx: WorkerContext, *callbacks: LoopCallback) -> WorkerContext:
    """`ctx` with more of the loop's side concerns (trainers/callbacks/)."""
    return replace(ctx, callbacks=[*ctx.callbacks, *callbacks])


def plain_context(rank: int = 0, world_size: int = 1, device: Any = None) -> WorkerContext:
    """A context for building an adapter outside a run (nothing is reported)."""
    return WorkerContext(rank=rank, world_size=world_size, report=lambda *report: None, epochs=1,
                         device=device)


def _wait_for_every_rank() -> None:
    """`ray.train.report` is collective: a checkpoint is whole only once every rank has reported its part. Ranks
    in a gloo rank pool share torch.distributed's default group, so they wait there: without it rank 0 could read
    a sharded checkpoint while rank 1 is still copying its shard in. Other harness users (TensorFlow, Horovod
    subprocesses) have no torch.distributed group and do not wait here."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_attempt(run: Callable[[WorkerContext], bool], rank: int, world_size: int, epochs: int, folder: Path,
                restored: Path | None = None, stop: bool = False) -> Attempt:
    """One attempt of `run(ctx) -> finished` with its checkpoints in `folder` (shared by the ranks)."""
    folder.mkdir(parents=True, exist_ok=True)
    stop_file = folder / "STOP"
    if stop and rank == 0:
        stop_file.touch()
    recorder, reports = Recorder(), []
    ctx = make_context(rank, world_size, epochs, folder, recorder, reports, restored,
                       stop_file if stop else None)
    finished = run(ctx)
    return Attempt(finished, recorder, reports, last_checkpoint(folder))


def last_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint reported in `folder` (whole: reports wait for every rank)."""
    checkpoints = sorted(folder.glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    return checkpoints[-1] if checkpoints else None


def check_stop_resume_parity(run: Callable[[WorkerContext], bool], tmp: Path, rank: int = 0, world_size: int = 1,
                             epochs: int = 2, text: bool = False, rtol: float = 1e-6, atol: float = 1e-7,
                             barrier: Callable[[], None] = lambda: None) -> dict[str, Attempt]:
    """Straight run, stopped run, resumed run (`barrier` between attempts: the ranks share the STOP file and
    the checkpoints); asserts the contract on rank 0. Returns the attempts."""
    straight = run_attempt(run, rank, world_size, epochs, tmp / "straight")
    barrier()
    stopped = run_attempt(run, rank, world_size, epochs, tmp / "stopped", stop=True)
    barrier()
    resumed = run_attempt(run, rank, world_size, epochs, tmp / "resumed", restored=last_checkpoint(tmp / "stopped"))
    runs = {"straight": straight, "stopped": stopped, "resumed": resumed}
    if rank == 0:
        check_parity(runs, epochs, text, rtol, atol)
    return runs


def check_parity(runs: dict[str, Attempt], epochs: int, text: bool, rtol: float, atol: float) -> None:
    """The stop/resume contract on rank 0's records of the three attempts."""
    straight, stopped, resumed = runs["straight"], runs["stopped"], runs["resumed"]
    assert straight.finished and resumed.finished and not stopped.finished
    # The stop report: where it stopped, and the monitored metric at its worst (never kept as a best checkpoint).
    assert stopped.reports[-1] == {**dict(zip(STOP_METRICS, (1.0, float(STOP_AT)))),
                                   "test_accuracy": -sys.float_info.max}
    assert stopped.recorder.epochs == {} and sorted(stopped.recorder.step_losses) == list(range(1, STOP_AT + 1))
    assert resumed.recorder.resumed == [0]
    assert min(resumed.recorder.step_losses) == STOP_AT + 1  # the trained steps were skipped
    combined = Recorder(step_losses={**stopped.recorder.step_losses, **resumed.recorder.step_losses})
    np.testing.assert_allclose(combined.curve(), straight.recorder.curve(), rtol=rtol, atol=atol)
    check_metric_set(straight.recorder, epochs, text)
    check_metric_set(resumed.recorder, epochs, text)
    # Epoch 1's totals continue the stopped epoch's: its loss is the mean over all of its steps.
    np.testing.assert_allclose(resumed.recorder.epochs[1]["train_loss"], straight.recorder.epochs[1]["train_loss"],
                               rtol=max(rtol, 1e-6))


def check_metric_set(recorder: Recorder, epochs: int, text: bool) -> None:
    """The contract's metric set, every epoch: exactly metric_names(text), plus data_load_s at the first."""
    assert sorted(recorder.epochs) == list(range(1, epochs + 1))
    first = min(recorder.epochs)
    for epoch, metrics in recorder.epochs.items():
        expected = set(metric_names(text=text)) | (set(FIRST_EPOCH_METRICS) if epoch == first else set())
        assert set(metrics) == expected, (epoch, sorted(metrics))
        assert all(np.isfinite(v) for v in metrics.values())


def mnist_columns(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Learnable fake digits in the MNIST shard layout (uint8 images [N, 784], int labels)."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 784))
    labels = rng.integers(0, 10, size=rows)
    images = np.clip(templates[labels] + rng.normal(0, 40, size=(rows, 784)), 0, 255).astype(np.uint8)
    return {"image": images, "label": labels.astype(np.int64)}


def imdb_columns(rows: int, vocab: int, max_len: int, seed: int = 0,
                 min_len: int | None = None) -> dict[str, np.ndarray]:
    """Token shards (input_ids [N, T] padded with 0, length, label, id) whose label shows in the tokens; rows of
    `min_len` (default max_len / 4) to `max_len` tokens."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=rows)
    lengths = rng.integers(max_len // 4 if min_len is None else min_len, max_len + 1, size=rows)
    ids = rng.integers(5, vocab, size=(rows, max_len))
    ids[:, 0] = 5 + labels  # a sentiment token
    ids[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
    return {"input_ids": ids.astype(np.int32), "length": lengths.astype(np.int32), "label": labels.astype(np.int64),
            "id": np.arange(rows, dtype=np.int64)}


def shard(columns: dict[str, np.ndarray], rank: int, ranks: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s contiguous part, as OrderedSplit splits in file order."""
    rows = len(columns["label"]) // ranks
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in columns.items()}


def config(folder: Path, overrides: list[str]) -> Any:
    """The real validated config (pipelines.config) for an in-process run. The data comes from the test, so
    `data.path` only needs the manifest file the validation looks for."""
    from pipelines.config import load_config

    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "manifest.json").write_text("{}")
    return load_config([*overrides, f"data.path={data}", f"run.storage_path={folder / 'ray'}"])
