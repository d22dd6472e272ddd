"""Rank 0's logger: each epoch's metrics (once per epoch, whatever restarts replay), step losses sent together
from a thread of its own, diagnostics and artifacts, through its `TrackingSpool`; TensorBoard event files too."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from contract.tracking.spool import TrackingSpool


STEP_LOSS_SEND_S = 5.0  # rank 0 sends its kept step losses at least this often


class EpochLogger:
    """Rank 0's per-epoch metrics, through its `TrackingSpool`. Logging is idempotent per (metric, epoch): after a
    worker failure the resumed run may replay an epoch whose metrics were already logged, and MLflow must hold
    each once. With `tensorboard_dir` the same epoch metrics (step = epoch) and step losses (step = global step)
    also go to a TensorBoard event file there, logged as the run's `tensorboard/` artifacts after every epoch.

    `since_ms`: the start of this line of training when it continues another checkpoint (`run.resume_from`: a PBT
    trial exploiting another's). Its epochs are logged even where the run already holds that epoch from the
    line it left (Ray Train runs an epoch ahead of Tune's decision to switch): MLflow keeps both points, the
    later one is the step's latest value (and `epoch_values` reads it so)."""

    def __init__(self, spool: TrackingSpool, tensorboard_dir: Path | None = None, since_ms: int = 0):
        self.spool = spool
        self.tensorboard_dir = tensorboard_dir
        self.since_ms = since_ms
        self._events: Any = None
        self._step_losses: list[list] = []  # [name, value, timestamp ms, step], not sent yet
        self._oldest_step_loss = 0.0        # time.monotonic() of the first of them
        self._sender: ThreadPoolExecutor | None = None  # sends kept step losses off the training thread
        self._sending: Future | None = None  # that send, until it is known to be done

    def _to_tensorboard(self, step: int, metrics: Mapping[str, float]) -> None:
        """Written at once: tensorboardX's EventsWriter (its SummaryWriter queues events for a thread, so a flush
        does not promise they are in the file yet); no framework needed."""
        if self.tensorboard_dir is None:
            return
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        if self._events is None:
            self.tensorboard_dir.mkdir(parents=True, exist_ok=True)
            self._events = EventsWriter(str(self.tensorboard_dir / "events"))
        for name, value in metrics.items():
            self._events.write_event(Event(wall_time=time.time(), step=step, summary=scalar(name, float(value))))
        self._events.flush()

    def log_step_loss(self, step: int, loss: float) -> None:
        """Kept and sent together, every STEP_LOSS_SEND_S by a thread of the logger's own while training goes on,
        and before anything else is logged (the epoch's end): a request per logged step makes every few steps wait
        for the tracking server's round trip, and even one every 5 s holds up a small model's training measurably
        (benchmarks/tracking_overhead.py, benchmarks/README.md). A worker that
        dies loses its last few seconds of step losses; the restarted run trains those steps again."""
        if not self._step_losses:
            self._oldest_step_loss = time.monotonic()
        self._step_losses.append(["step_loss", float(loss), now_ms(), step])
        self._to_tensorboard(step, {"step_loss": loss})
        if time.monotonic() - self._oldest_step_loss >= STEP_LOSS_SEND_S:
            self._send_step_losses(wait=False)

    def flush(self) -> None:
        """Send the step losses kept so far, and wait until every one is sent (or spooled)."""
        self._send_step_losses(wait=True)

    def _send_step_losses(self, wait: bool) -> None:
        # One send at a time and every other write after it: the spool is never used by two threads at once.
        if self._sending is not None:
            self._sending.result()
            self._sending = None
        if not self._step_losses:
            return
        record, self._step_losses = {"op": "metrics", "metrics": self._step_losses}, []
        if wait:
            self.spool.write(record)
            return
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-step-losses")
        self._sending = self._sender.submit(self.spool.write, record)

    def resumed_from(self, epoch: int, steps: int = 0) -> None:
        """Record a restart from the checkpoint of `epoch` (tag `resumed_from_epoch`, comma-separated), one taken
        `steps` steps into the next epoch too (tag `resumed_from_step`: "epoch E step S", comma-separated)."""
        self.flush()
        self.spool.write({"op": "append_tag", "key": "resumed_from_epoch", "value": str(epoch)})
        if steps:
            self.spool.write({"op": "append_tag", "key": "resumed_from_step",
                              "value": f"epoch {epoch + 1} step {steps}"})

    def log_extra(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """Per-epoch diagnostics (per-rank stats) logged as they come, without the once-per-epoch check."""
        self.flush()
        now = now_ms()
        self.spool.write({"op": "metrics", "metrics": [[k, float(v), now, epoch] for k, v in metrics.items()]})

    def tag(self, key: str, value: str) -> None:
        self.spool.write({"op": "tag", "key": key, "value": value})

    def append_tag(self, key: str, value: str) -> None:
        """`value` added to the tag `key` (comma-separated): one part per attempt."""
        self.spool.write({"op": "append_tag", "key": key, "value": value})

    def log_artifacts(self, folder: str, path: str) -> None:
        """The files in `folder` (on this worker's node) as the run's artifacts under `path`."""
        self.flush()
        self.spool.write({"op": "artifacts", "folder": folder, "path": path})

    def log(self, epoch: int, metrics: Mapping[str, float]) -> None:
        self.flush()
        now = now_ms()
        self.spool.write({"op": "metrics", "once_per": "train_loss", "since_ms": self.since_ms,
                          "metrics": [[k, float(v), now, epoch] for k, v in metrics.items()]})
        if self.tensorboard_dir is not None:
            self._to_tensorboard(epoch, metrics)
            self.log_artifacts(str(self.tensorboard_dir), "tensorboard")


def now_ms() -> int:
    return int(time.time() * 1000)


def epoch_values(points: list[Any]) -> list[float]:
    """A metric's history (MLflow `Metric`s) as one value per step, in step order: a step logged twice (a PBT trial
    that switched to another's checkpoint) counts its latest value."""
    latest = {m.step: m for m in sorted(points, key=lambda m: (m.step, m.timestamp))}
    return [latest[step].value for step in sorted(latest)]


def lineage_start_ms(folder: Path) -> int:
    """When the Ray Train run in `folder` first started (recorded there by its first attempt; a restarted worker
    group reads it back), in ms."""
    marker = Path(folder) / "lineage_started_ms"
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(now_ms()))
    return int(marker.read_text())
