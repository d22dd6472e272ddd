"""A sweep's MLflow runs: the parent run (the sweep config, the rejected points, the report) and a child run per
trial, opened by the trial when it first starts (so each child's start and end are its trial's) and closed by the
sweep with how each trial ended; and the end of a sweep whose tracking server is away then, kept in the parent's
spool folder for `rtp replay`."""
from __future__ import annotations

import csv
import io
import json
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from contract import resume, tracking
from contract.files import write_atomically
from pipelines.config import flatten, parallel_params
from pipelines.data.shards import dataset_refs, read_manifest
from pipelines.fit import replay_run
from pipelines.sweep.space import Trial, trial_name


def start_parent(uri: str, spec: DictConfig, trials: list[Trial], cluster: dict[str, Any]) -> str:
    """The sweep's MLflow run: the sweep config, cluster, concurrency and every rejected point."""
    base = next(t.cfg for t in trials if t.cfg is not None)
    params = {f"sweep.{k}": v for k, v in flatten(spec).items()}
    params.update({f"cluster.{k}": v for k, v in cluster.items()})
    params["run.storage_path"] = base.run.storage_path  # where its ending waits if the server is away at the end
    run_id = tracking.start_run(uri, base.run.experiment, f"sweep-{spec.name}", params, OmegaConf.to_yaml(spec))
    rejected = [{"index": t.index, "combo": t.combo, "reason": t.reason} for t in trials if t.cfg is None]
    client = tracking.mlflow_client(uri)
    with tracking.ended_on_error(uri, run_id):  # not yet recorded: a failure here ends it
        client.log_text(run_id, json.dumps(rejected, indent=2), "rejected.json")
        client.log_text(run_id, rejected_csv(rejected), "rejected.csv")
        for key, value in (("trials_total", len(trials)), ("trials_rejected", len(rejected)),
                           ("trials_valid", len(trials) - len(rejected))):
            client.log_metric(run_id, key, value)
    return run_id


def rejected_csv(rejected: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["index", "combo", "reason"])
    for row in rejected:
        writer.writerow([row["index"], " ".join(f"{k}={v}" for k, v in row["combo"].items()), row["reason"]])
    return out.getvalue()


def child_specs(parent_id: str, valid: list[Trial]) -> dict[int, dict[str, Any]]:
    """What each valid trial's child run is created with (by the trial when it first starts, `child_run`): its
    name (`trial_name`), params, config and tags, the sweep driver's among them (the run is the sweep's to close)."""
    names = Counter(trial_name(trial) for trial in valid)
    specs = {}
    for trial in valid:
        name = trial_name(trial)
        if names[name] > 1:  # equal grid points (`sweep.num_samples` without distributions): told apart by index
            name = f"{name}-#{trial.index}"
        tags = {"mlflow.parentRunId": parent_id, "sweep.trial_index": str(trial.index),
                "sweep.overrides": " ".join(trial.overrides), **tracking.driver_tags()}
        params = {**flatten(trial.cfg), **parallel_params(trial.cfg)}
        specs[trial.index] = {"name": name, "tags": tags, "params": params, "config_yaml": OmegaConf.to_yaml(trial.cfg)}
    return specs


def trials_folder(storage_path: str, parent_id: str) -> Path:
    """Where each trial records its child run (`<index>.json`: its run id, when it ended), on shared storage."""
    return tracking.run_dir(storage_path, parent_id) / "trials"


def child_run(uri: str, folder: Path, index: int, spec: dict[str, Any], cfg: Any) -> str:
    """Trial `index`'s child run: the one it recorded in `folder` (a restart by Tune, a continued sweep), else a
    new one, created now, so that its start in MLflow is the trial's. Only this trial writes its record."""
    record = folder / f"{index}.json"
    if record.is_file():
        return json.loads(record.read_text())["run_id"]
    run_id = tracking.start_run(uri, cfg["run"]["experiment"], spec["name"], spec["params"], spec["config_yaml"],
                                tags=spec["tags"])
    write_record(record, {"run_id": run_id})  # at once: a trial restarted after a failure below continues this run
    data = cfg["data"]
    tracking.log_dataset_inputs(uri, run_id, dataset_refs(
        data["path"], read_manifest(data["path"]), {"training": "train", "eval": data["eval_split"]}))
    return run_id


def note_trial_time(folder: Path, index: int) -> None:
    """The trial's latest moment (a report; its function's return or exception): its child run's end time, once
    it has ended."""
    record = folder / f"{index}.json"
    write_record(record, {**json.loads(record.read_text()), "ended_ms": tracking.now_ms()})


def write_record(path: Path, record: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(record))  # a reader never sees half a record


def recorded_children(folder: Path) -> dict[int, dict[str, Any]]:
    """{trial index: its record} of every trial that has started."""
    return {int(p.stem): json.loads(p.read_text()) for p in folder.glob("*.json")} if folder.is_dir() else {}


@dataclass
class Outcome:
    status: str                 # MLflow run status: FINISHED | FAILED | KILLED
    message: str | None = None
    early_stop: int | None = None  # the epoch whose report made the scheduler, `sweep.stop` or the budget end it
    out_of_time: bool = False      # cut short by `sweep.time_budget_s`: not a failure
    stopped_at: str | None = None  # "epoch E step S" of a STOP request, recorded as a single run records it

    @property
    def failed(self) -> bool:
        return self.status != "FINISHED" and not self.out_of_time


def close_children(uri: str, children: dict[int, str], outcomes: dict[int, Outcome],
                   ends: dict[int, int] | None = None) -> None:
    """End each child run with its trial's outcome, at the time its trial ended (`ends`, ms; else now)."""
    for index, run_id in children.items():
        outcome = outcomes.get(index, Outcome("KILLED", "the sweep stopped before this trial ended"))
        end_ms = (ends or {}).get(index)
        if outcome.status == "KILLED":
            tracking.mlflow_client(uri).set_tag(run_id, "sweep.not_finished", outcome.message)
            if outcome.stopped_at is not None:  # KILLED with tag `preempted_at`, kept when the rerun continues it
                tracking.mark_preempted(uri, run_id, outcome.stopped_at, end_ms=end_ms)
            else:
                tracking.mlflow_client(uri).set_terminated(run_id, status="KILLED", end_time=end_ms)
        else:
            if outcome.early_stop is not None:  # why it has fewer epochs and, usually, no final model
                tracking.mlflow_client(uri).set_tag(run_id, "sweep.stopped_early_after_epoch", str(outcome.early_stop))
            tracking.end_run(uri, run_id, error=outcome.message if outcome.status == "FAILED" else None,
                             end_ms=end_ms)


def still_running(uri: str, children: dict[int, str]) -> dict[int, str]:
    """Those of `children` ({trial index: run id}) that are RUNNING in MLflow."""
    client = tracking.mlflow_client(uri)
    return {index: run_id for index, run_id in children.items() if client.get_run(run_id).info.status == "RUNNING"}


def report(uri: str, spec: DictConfig, parent_id: str, register_model: str | None) -> str:
    """Build the scaling report from the child runs and log it to the parent run, and register the best trial's
    model as `register_model` if given; returns the Markdown."""
    from pipelines.sweep.report import build_report, read_trials

    client = tracking.mlflow_client(uri)
    with tempfile.TemporaryDirectory() as directory:
        result = build_report(read_trials(uri, parent_id), Path(directory), spec.target_accuracy, spec.metric,
                              spec.mode)
        client.log_artifacts(parent_id, directory, "report")
    if result.best is not None:
        client.set_tag(parent_id, "best.run_id", result.best["run_id"])
        client.set_tag(parent_id, "best.trial", result.best["trial"])
        client.log_metric(parent_id, f"best.{spec.metric}", result.best[spec.metric])
        if register_model:  # the best trial may be one ASHA stopped early, without a model: say so, go on
            try:
                version = tracking.register_logged_model(uri, result.best["run_id"], register_model)
                client.set_tag(parent_id, "registered_model", f"{register_model}/{version}")
            except RuntimeError as err:
                print(f"warning: {err}", file=sys.stderr)
    return result.markdown


@dataclass
class SweepEnding:
    """Everything the end of a sweep tells MLflow once its trials have ended: kept as `sweep.json` in the parent
    run's spool folder when the tracking server is away then, for `pipelines.replay` to finish the sweep."""
    parent_id: str
    uri: str
    spec: dict[str, Any]
    pending: dict[int, str]          # the child runs this attempt ran: {trial index: run id}
    outcomes: dict[int, Outcome]
    trials: int                      # all of the sweep's trials, this attempt's or not
    stopping: bool                   # `run.resume_dir` holds STOP
    register_model: str | None
    storage_path: str
    ends: dict[int, int] = field(default_factory=dict)  # when each trial of `pending` ended (ms), where recorded

    def save(self) -> Path:
        folder = tracking.spool_dir(self.storage_path, self.parent_id)
        record = {**asdict(self), "outcomes": {i: asdict(o) for i, o in self.outcomes.items()}}
        write_atomically(folder / tracking.SWEEP_FILE, json.dumps(record, indent=2))  # `rtp replay` reads it whole
        return folder

    @classmethod
    def load(cls, folder: Path) -> "SweepEnding":
        record = json.loads((folder / tracking.SWEEP_FILE).read_text())
        record["pending"] = {int(i): run_id for i, run_id in record["pending"].items()}
        record["outcomes"] = {int(i): Outcome(**o) for i, o in record["outcomes"].items()}
        record["ends"] = {int(i): end for i, end in record.get("ends", {}).items()}
        return cls(**record)


class SweepTrackingDown(RuntimeError):
    def __init__(self, ending: SweepEnding, folder: Path):
        super().__init__(f"MLflow tracking server {ending.uri} is unreachable; the sweep's {len(ending.pending)} "
                         f"trial(s) have ended and what MLflow has not heard (their records, final models and how "
                         f"each ended) is kept in {folder}: once the server is back, finish the sweep with "
                         f"`rtp replay {folder}`")
        self.parent_id = ending.parent_id


def finish_sweep(ending: SweepEnding) -> tuple[int, bool]:
    """Tell MLflow how the trials ended: each trial's spooled records and final model (a trial the server did not
    hear at its end), the child runs' status, then the report and the parent run's status (KILLED with
    `preempted_at` when the sweep stops on request). Returns (failed trials, whether the sweep stopped with trials
    to continue). Raises SweepTrackingDown, after saving `ending`, when the server does not answer."""
    uri, parent_id = ending.uri, ending.parent_id
    if not tracking.answers(uri):
        raise SweepTrackingDown(ending, ending.save())
    for run_id in ending.pending.values():
        folder = tracking.spool_dir(ending.storage_path, run_id)
        if tracking.spool_files(folder) or (folder / tracking.FINAL_FILE).is_file():
            replay_run(folder, uri)
    close_children(uri, ending.pending, ending.outcomes, ending.ends)
    failed = sum(o.failed for o in ending.outcomes.values())
    if failed and ending.stopping:
        tracking.mark_preempted(uri, parent_id, f"{failed} of {ending.trials} trials unfinished")
        return failed, True
    tracking.mlflow_client(uri).log_metric(parent_id, "trials_failed", failed)
    spec = OmegaConf.create(ending.spec)
    print(report(uri, spec, parent_id, ending.register_model), flush=True)
    if failed:
        tracking.end_run(uri, parent_id, error=f"{failed} trial(s) did not finish; see the child runs' status")
    else:
        tracking.end_run(uri, parent_id)
    return failed, False


def finish_recorded_sweep(folder: Path, uri: str | None = None) -> tuple[str, str]:
    """`pipelines.replay` of a sweep's spool folder: `finish_sweep` from its `sweep.json`, on the server at `uri`
    (else the one the sweep used). Returns (parent run id, how the sweep ended, in words)."""
    ending = SweepEnding.load(folder)
    if uri:
        ending.uri = uri
    tracking.check_reachable(ending.uri)
    failed, stopped = finish_sweep(ending)
    (folder / tracking.SWEEP_FILE).unlink()
    if stopped:
        return ending.parent_id, (f"stopped on request with {failed} trial(s) unfinished: continue it with the same "
                                  f"run.resume_dir")
    return ending.parent_id, f"{failed} trial(s) did not finish" if failed else "every trial finished"


def open_sweep(uri: str, spec: DictConfig, trials: list[Trial], cluster: dict[str, Any],
               resume_dir: str | None) -> tuple[str, list[int]]:
    """The parent run: a new one (recorded in `run.resume_dir` when set), or the one of the sweep recorded there,
    reopened with its unfinished child runs. Returns (parent id, indices of the trials to run: all of a new sweep;
    a continued sweep's trials that never started or whose child run has not finished)."""
    valid = [t for t in trials if t.cfg is not None]
    tracking.close_orphaned_runs(uri, valid[0].cfg.run.experiment)
    recorded = resume.recorded_sweep(resume_dir)
    if recorded is None:
        parent_id = start_parent(uri, spec, trials, cluster)
        with tracking.ended_on_error(uri, parent_id):  # not yet recorded: a failure here ends it
            for data_path in {t.cfg.data.path for t in valid}:  # lineage, as a training run logs it
                tracking.log_data_files(uri, parent_id, data_path, read_manifest(data_path))
            resume.record_sweep(resume_dir, parent_id, {})
        return parent_id, [t.index for t in valid]
    parent_id, in_resume_dir = recorded
    tracking.reopen_run(uri, parent_id)
    folder = trials_folder(valid[0].cfg.run.storage_path, parent_id)
    for index, run_id in in_resume_dir.items():  # a sweep recorded before trials kept their own records
        if not (folder / f"{index}.json").is_file():
            write_record(folder / f"{index}.json", {"run_id": run_id})
    started = recorded_children(folder)
    to_run = []
    for trial in valid:
        run_id = started.get(trial.index, {}).get("run_id")
        if run_id is None or tracking.reopen_run(uri, run_id) != "FINISHED":
            to_run.append(trial.index)
            client = tracking.mlflow_client(uri)
            if run_id is not None and "sweep.not_finished" in client.get_run(run_id).data.tags:  # said by the
                client.delete_tag(run_id, "sweep.not_finished")                                   # stopped attempt
    return parent_id, to_run


def children_of(uri: str, parent_id: str, valid: list[Trial], indices: list[int],
                resume_dir: str | None) -> tuple[dict[int, str], dict[int, int]]:
    """After the trials of `indices` ran (or were interrupted): ({index: child run id}, {index: when it ended,
    ms}). A trial that never started gets its child run now, to be closed as not run (unless the tracking server
    is away: the sweep's ending then waits for `rtp replay` without it). Recorded in `run.resume_dir` too, for
    whoever reads the sweep's runs from there."""
    folder = trials_folder(valid[0].cfg.run.storage_path, parent_id)
    started, specs = recorded_children(folder), child_specs(parent_id, valid)
    configs = {t.index: OmegaConf.to_container(t.cfg, resolve=True) for t in valid}
    unstarted = [i for i in indices if i not in started] if tracking.answers(uri) else []
    children = {**{i: started[i]["run_id"] for i in indices if i in started},
                **{i: child_run(uri, folder, i, specs[i], configs[i]) for i in unstarted}}
    resume.record_sweep(resume_dir, parent_id, {i: r["run_id"] for i, r in recorded_children(folder).items()})
    return children, {i: started[i]["ended_ms"] for i in indices if "ended_ms" in started.get(i, {})}
