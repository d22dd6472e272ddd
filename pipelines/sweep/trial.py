"""One sweep trial, in its Tune actor: fit the trial's backend the way a training run does (pipelines/fit.py) and
pass every epoch's report on to Tune, with the epoch's checkpoint when the scheduler needs Tune to hold them (PBT).

Ray Train V2 reports from its controller actor; `TrialReporter` runs there and hands each report over a Ray queue
to this trial's Tune function, which reports it to Tune. (Tune's own `TuneReportCallback` passes metrics only: a
function trainable's checkpoint must come from `tune.report`, and PBT exploits only checkpoints Tune holds.)

A trial that Tune starts from a checkpoint (PBT: the checkpoint of the trial it exploits, or its own after a pause)
trains from it as `run.resume_from` in a Ray Train run of its own, continuing its own MLflow child run: tag
`pbt.exploited` lists `trial<index>@epoch<E>` for every checkpoint of another trial it continued, and the metrics
`hparam.<key>` the value of every mutated key from the epoch it took effect.
"""
from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable

from ray.train import UserCallback

from contract import resume, tracking
from contract.checkpoint import TrainState
from contract.console import say
from contract.config import typed_config
from contract.metrics import STEP_CHECKPOINT_METRICS
from pipelines.fit import fit_backend
from pipelines.sweep.runs import child_run, note_trial_time
import trainers  # noqa: F401  (registers the built-in backends and models: a trial types its config)

DONE = "done"  # the last item on a trial's report queue: its Ray Train run has ended


class TrialReporter(UserCallback):
    """In the Ray Train controller: every report (rank 0's metrics, the checkpoint's path) onto the trial's queue."""

    def __init__(self, reports: Any):
        self.reports = reports

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        self.reports.put((dict(metrics[0]), checkpoint.path if checkpoint is not None else None))


def run_trial(config: dict[str, Any], specs: dict[int, dict[str, Any]]) -> None:
    """One Tune trial. `config`: the trial index and the current values of the mutated keys (PBT's); `specs`: each
    trial's config, child run (`runs.child_specs`) and tracking URI. The trial's child run is created when it
    first starts (`runs.child_run`); rank 0 logs to it, the final model is logged to it (a trial Tune stops early
    ends without one, and so does a trial stopped on request), and its end is recorded for the sweep to close it."""
    index = config["trial_index"]
    spec = specs[index]
    if resume.stop_requested(spec["cfg"]["run"]["resume_dir"]):  # the sweep is stopping: leave this trial for the rerun
        return
    folder = Path(spec["trials_folder"])
    run_id = child_run(spec["tracking_uri"], folder, index, spec["child"], spec["cfg"])
    try:
        train_trial(config, {**spec, "run_id": run_id}, index, lambda: note_trial_time(folder, index))
    finally:
        note_trial_time(folder, index)


def train_trial(config: dict[str, Any], spec: dict[str, Any], index: int, note_time: Callable[[], None]) -> None:
    """The trial's Ray Train run, each of its reports passed on to Tune. `note_time` before each: a trial that Tune
    stops at a report (ASHA, `sweep.stop`) ends there."""
    from ray import tune
    from ray.util.queue import Queue

    plain = copy.deepcopy(spec["cfg"])
    for key in spec["mutable"]:
        section, name = key.split(".")
        plain[section][name] = config[key]
    restored = tune.get_checkpoint()
    if restored is not None:
        plain["run"]["resume_from"] = restored.path
    if spec["mutable"]:
        note_start(spec, index, restored, {key: config[key] for key in spec["mutable"]})

    reports = Queue(maxsize=1, actor_options={"num_cpus": 0})
    ended: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            fit_backend(typed_config(plain, spec["plugin_roots"]), spec["run_id"], spec["tracking_uri"],
                        callbacks=[TrialReporter(reports)])
        except BaseException as err:  # re-raised in the trial's thread
            ended["error"] = err
        finally:
            reports.put(DONE)

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    while (item := reports.get()) != DONE:
        metrics, path = item
        if STEP_CHECKPOINT_METRICS[0] in metrics:  # inside an epoch: Ray Train's to restart from, not Tune's
            continue
        note_time()
        tune.report(metrics, checkpoint=tune_checkpoint(path, index, spec["run_id"])
                    if path and spec["tune_checkpoints"] else None)
    thread.join()
    if isinstance(ended.get("error"), tracking.TrackingDown):  # trained: not a failure for Tune to retry
        say(f"trial {index}: {ended['error']}")       # the driver finishes the run
    elif "error" in ended:
        raise ended["error"]


def tune_checkpoint(path: str, index: int, run_id: str) -> Any:
    """The Ray Train checkpoint at `path` for Tune to copy, labelled with the trial it comes from."""
    from ray.tune import Checkpoint

    checkpoint = Checkpoint.from_directory(path)
    checkpoint.set_metadata({"trial_index": index, "run_id": run_id})
    return checkpoint


def note_start(spec: dict[str, Any], index: int, restored: Any, values: dict[str, Any]) -> None:
    """In the trial's child run: the mutated keys' values from the epoch this attempt starts, and the trial whose
    checkpoint it continues when that is another's."""
    epoch = TrainState.read(restored.path).epoch if restored is not None else 0
    records: list[dict[str, Any]] = [{"op": "metrics", "metrics": [
        [f"hparam.{key}", float(value), tracking.now_ms(), epoch + 1] for key, value in values.items()]}]
    donor = (restored.get_metadata() or {}).get("trial_index") if restored is not None else None
    if donor is not None and donor != index:
        records.append({"op": "append_tag", "key": "pbt.exploited", "value": f"trial{donor}@epoch{epoch}"})
    run_id, cfg = spec["run_id"], spec["cfg"]
    tracking.send_or_spool(spec["tracking_uri"], run_id, tracking.spool_dir(cfg["run"]["storage_path"], run_id),
                           f"trial{index}", records)
