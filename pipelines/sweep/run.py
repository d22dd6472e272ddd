"""Sweep parallelism degrees with Ray Tune: `python -m pipelines.sweep sweep=parallelism [overrides]`.

Arguments: `sweep=<name>` picks `conf/sweep/<name>.yaml`, `sweep.key=value` overrides it, anything else is a
training override applied to every trial (e.g. `data.path=...`, `trainer.epochs=2`). What `ray job submit`
runs; uses the cluster at RAY_ADDRESS when set, else starts a local Ray.

Each grid point is validated like a training run; impossible ones are rejected before launch and logged to the
parent MLflow run (`rejected.json`, `rejected.csv`, metric `trials_rejected`). Each valid point is one Tune
trial, in a child MLflow run created here (tag `mlflow.parentRunId`), whose function builds and fits the
backend's Ray Train trainer and reports its epochs to Tune (pipelines/sweep_trial.py). The scheduler is FIFO,
ASHA or PBT (pipelines/sweep_pbt.py). The scaling report (Markdown, CSV, plots) is built from the child runs at
the end and logged to the parent run.

Last stdout line: `mlflow_parent_run_id=<id>`. Exit codes: 0 every trial finished (ASHA's early stops count as
finished); 1 a trial failed or never completed an epoch, or the sweep failed (the report still covers the trials
that ran), or the tracking server was away when the trials ended (`python -m pipelines.replay` then finishes it);
2 bad config, data or tracking server, or no valid trial (nothing was started); 3 stopped on request
(`run.resume_dir` holds STOP): the unfinished trials checkpointed, the parent run is KILLED, and a rerun with the
same `run.resume_dir` continues the same parent and re-runs only the unfinished trials, each from its checkpoint.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from contract import resume, tracking
from contract.metrics import REPORTED_EPOCH
from pipelines.config import ConfigError, check_fits_this_machine, flatten, parallel_params
from pipelines.data.idx import DataError
from pipelines.data.shards import dataset_refs, read_manifest, shard_paths
from pipelines.fit import init_ray, replay_run, stopped_at
from pipelines.ray_session import shutdown_ray
from pipelines.sweep_pbt import PBT_CHECKPOINTS_KEPT, check_mutated_trials, make_pbt, mutations, param_space
from pipelines.sweep_space import (Trial, cpus_needed, load_sweep, max_concurrent, plan_trials, reject_unfit,
                                   split_argv, stop_thresholds, trial_name)


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient  # lazy: config errors must come back fast

    return MlflowClient(tracking_uri=uri)


def validate(argv: list[str]) -> tuple[DictConfig, list[Trial], str, str | None]:
    """Everything that can be checked before taking cluster resources. Returns (sweep spec, trials, tracking URI,
    `run.resume_dir`)."""
    name, sweep_overrides, train_overrides = split_argv(argv)
    spec = load_sweep(name, sweep_overrides)
    mutable = mutations(spec)
    trials = plan_trials(spec, train_overrides)
    check_mutated_trials(spec, trials, mutable)
    for trial in trials:
        try:
            if trial.cfg is not None:
                check_fits_this_machine(trial.cfg)
        except ConfigError as err:
            trial.cfg, trial.reason = None, str(err)
    valid = [t for t in trials if t.cfg is not None]
    if not valid:
        raise ConfigError("sweep.grid: no valid trial:\n" + rejected_text(trials))
    for data_path, split in {(t.cfg.data.path, t.cfg.data.eval_split) for t in valid}:
        manifest = read_manifest(data_path)
        for each in ("train", split):
            shard_paths(data_path, manifest, each)
    resume_dir = valid[0].cfg.run.resume_dir  # a `run` key: the same for every trial
    recorded = resume.recorded_sweep(resume_dir)
    missing = sorted(set(recorded[1]) - {t.index for t in valid}) if recorded else []
    untold = tracking.spool_dir(valid[0].cfg.run.storage_path, recorded[0]) if recorded else None
    if untold is not None and (untold / tracking.SWEEP_FILE).is_file():
        raise ConfigError(f"run.resume_dir: MLflow has not heard how the last attempt of the sweep recorded in "
                          f"{resume_dir} ended; run `python -m pipelines.replay {untold}` first")
    if missing:
        raise ConfigError(f"run.resume_dir: the sweep recorded in {resume_dir} has trials this grid lacks "
                          f"({missing}); continue it with the same sweep and overrides, or use another run.resume_dir")
    uri = tracking.tracking_uri()
    tracking.check_reachable(uri)
    return spec, trials, uri, resume_dir


def rejected_text(trials: list[Trial]) -> str:
    return "\n".join(f"  rejected #{t.index} {t.combo}: {t.reason}" for t in trials if t.cfg is None)


def start_ray(trials: list[Trial]) -> tuple[float, float]:
    """Connect (RAY_ADDRESS) or start a local Ray sized for the largest trial; returns (CPUs, GPUs). A trial that
    Tune stops early (ASHA) relies on Ray Train's placement-group cleaner to free its workers' resources for the
    next trials, which `init_ray` lets it find."""
    import ray

    valid = [cpus_needed(t.cfg) for t in trials if t.cfg is not None]
    init_ray(max(os.cpu_count() or 1, int(max(valid, default=1))))
    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def start_parent(uri: str, spec: DictConfig, trials: list[Trial], cluster: dict[str, Any]) -> str:
    """The sweep's MLflow run: the sweep config, cluster, concurrency and every rejected point."""
    base = next(t.cfg for t in trials if t.cfg is not None)
    params = {f"sweep.{k}": v for k, v in flatten(spec).items()}
    params.update({f"cluster.{k}": v for k, v in cluster.items()})
    run_id = tracking.start_run(uri, base.run.experiment, f"sweep-{spec.name}", params, OmegaConf.to_yaml(spec))
    rejected = [{"index": t.index, "combo": t.combo, "reason": t.reason} for t in trials if t.cfg is None]
    client = _client(uri)
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


def start_children(uri: str, parent_id: str, valid: list[Trial]) -> dict[int, str]:
    """One child run per valid trial, created before Tune starts: a trial that Tune restarts after a failure
    gets the same run id again and continues that run (and its Ray Train checkpoints, named after it)."""
    children = {}
    for trial in valid:
        tags = {"mlflow.parentRunId": parent_id, "sweep.trial_index": str(trial.index),
                "sweep.overrides": " ".join(trial.overrides)}
        params = {**flatten(trial.cfg), **parallel_params(trial.cfg)}
        children[trial.index] = tracking.start_run(uri, trial.cfg.run.experiment, trial_name(trial.cfg), params,
                                                   OmegaConf.to_yaml(trial.cfg), tags=tags)
        data = trial.cfg.data
        tracking.log_dataset_inputs(uri, children[trial.index], dataset_refs(
            data.path, read_manifest(data.path), {"training": "train", "eval": data.eval_split}))
    return children


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


def make_scheduler(spec: DictConfig, valid: list[Trial], mutable: dict[str, Any]) -> Any:
    if spec.scheduler == "pbt":
        return make_pbt(spec, mutable)
    if spec.scheduler != "asha":
        return None  # FIFO: every trial runs to its last epoch (or its `sweep.stop`)
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(metric=spec.metric, mode=spec.mode, grace_period=spec.asha_grace_period,
                         max_t=max(t.cfg.trainer.epochs for t in valid))


@dataclass
class ReachedStop:
    """Tune's stop condition from `sweep.stop`: a trial stops once an epoch reaches one of the thresholds."""
    thresholds: dict[str, tuple[float, str]]  # {metric: (value, "max" | "min")}

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return any(metric in result and (result[metric] >= value if mode == "max" else result[metric] <= value)
                   for metric, (value, mode) in self.thresholds.items())


def trial_config(cfg: DictConfig) -> dict[str, Any]:
    """A trial's config as plain data for its Tune actor. Trials register no model: the sweep registers its best
    trial's (`run.register_model`, in `report`)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["run"]["register_model"] = None
    return plain


def run_tune(spec: DictConfig, valid: list[Trial], children: dict[int, str], uri: str, parent_id: str,
             concurrency: int) -> dict[int, Outcome]:
    """Run every valid trial; returns {trial index: how it ended}."""
    from ray import tune

    from pipelines.sweep_trial import run_trial  # imports Ray Train: not before the config is checked

    mutable = mutations(spec)
    specs = {t.index: {"cfg": trial_config(t.cfg), "run_id": children[t.index], "tracking_uri": uri,
                       "mutable": list(mutable), "tune_checkpoints": spec.scheduler == "pbt"} for t in valid}
    # Only the Tune function's own CPU here: the trainer reserves its workers itself, outside Tune.
    trainable = tune.with_resources(tune.with_parameters(run_trial, specs=specs), {"cpu": 1})
    # PBT exploits the checkpoints Tune holds: keep enough that a trial behind can still load one.
    checkpoints = tune.CheckpointConfig(num_to_keep=PBT_CHECKPOINTS_KEPT if spec.scheduler == "pbt" else None)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space(valid, mutable),
        tune_config=tune.TuneConfig(max_concurrent_trials=concurrency, scheduler=make_scheduler(spec, valid, mutable),
                                    time_budget_s=spec.time_budget_s),
        run_config=tune.RunConfig(name=f"sweep-{parent_id}", storage_path=valid[0].cfg.run.storage_path,
                                  failure_config=tune.FailureConfig(max_failures=spec.trial_max_failures),
                                  checkpoint_config=checkpoints,
                                  stop=ReachedStop(stop_thresholds(spec)) if spec.stop else None, verbose=1),
    )
    start = time.monotonic()
    results = {result.config["trial_index"]: result for result in tuner.fit()}
    out_of_time = spec.time_budget_s is not None and time.monotonic() - start >= spec.time_budget_s
    return {t.index: outcome_of(results.get(t.index), t.cfg.trainer.epochs, out_of_time) for t in valid}


def outcome_of(result: Any, epochs: int, out_of_time: bool) -> Outcome:
    """How a trial ended, from its Tune result (None: Tune never started it). `out_of_time`: the sweep's time
    budget ran out, so a trial that did not complete an epoch was cut short by it, not failed."""
    if result is not None and result.error is not None:
        return Outcome("FAILED", f"{type(result.error).__name__}: {result.error}")
    metrics = result.metrics if result is not None else None
    if (stopped := stopped_at(metrics)) is not None:
        return Outcome("KILLED", f"stopped on request at {stopped}", stopped_at=stopped)
    if not metrics or "train_loss" not in metrics:
        if out_of_time:
            return Outcome("KILLED", "the sweep's time budget ran out before its first epoch ended", out_of_time=True)
        return Outcome("KILLED", "stopped before its first epoch ended" if result is not None
                       else "not run: the sweep stopped first")
    last = metrics.get(REPORTED_EPOCH, epochs)  # ran to the end, or was stopped early after at least one epoch
    return Outcome("FINISHED", early_stop=last if last < epochs else None)


def close_children(uri: str, children: dict[int, str], outcomes: dict[int, Outcome]) -> None:
    for index, run_id in children.items():
        outcome = outcomes.get(index, Outcome("KILLED", "the sweep stopped before this trial ended"))
        if outcome.status == "KILLED":
            _client(uri).set_tag(run_id, "sweep.not_finished", outcome.message)
            if outcome.stopped_at is not None:  # KILLED with tag `preempted_at`, kept when the rerun continues it
                tracking.mark_preempted(uri, run_id, outcome.stopped_at)
            else:
                _client(uri).set_terminated(run_id, status="KILLED")
        else:
            if outcome.early_stop is not None:  # why it has fewer epochs and, usually, no final model
                _client(uri).set_tag(run_id, "sweep.stopped_early_after_epoch", str(outcome.early_stop))
            tracking.end_run(uri, run_id, error=outcome.message if outcome.status == "FAILED" else None)


def report(uri: str, spec: DictConfig, parent_id: str, register_model: str | None) -> str:
    """Build the scaling report from the child runs and log it to the parent run, and register the best trial's
    model as `register_model` if given; returns the Markdown."""
    from pipelines.scaling_report import build_report, read_trials

    client = _client(uri)
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

    def save(self) -> Path:
        folder = tracking.spool_dir(self.storage_path, self.parent_id)
        folder.mkdir(parents=True, exist_ok=True)
        record = {**asdict(self), "outcomes": {i: asdict(o) for i, o in self.outcomes.items()}}
        (folder / tracking.SWEEP_FILE).write_text(json.dumps(record, indent=2))
        return folder

    @classmethod
    def load(cls, folder: Path) -> "SweepEnding":
        record = json.loads((folder / tracking.SWEEP_FILE).read_text())
        record["pending"] = {int(i): run_id for i, run_id in record["pending"].items()}
        record["outcomes"] = {int(i): Outcome(**o) for i, o in record["outcomes"].items()}
        return cls(**record)


class SweepTrackingDown(RuntimeError):
    def __init__(self, ending: SweepEnding, folder: Path):
        super().__init__(f"MLflow tracking server {ending.uri} is unreachable; the sweep's {len(ending.pending)} "
                         f"trial(s) have ended and what MLflow has not heard (their records, final models and how "
                         f"each ended) is kept in {folder}: once the server is back, finish the sweep with "
                         f"`python -m pipelines.replay {folder}`")
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
    close_children(uri, ending.pending, ending.outcomes)
    failed = sum(o.failed for o in ending.outcomes.values())
    if failed and ending.stopping:
        tracking.mark_preempted(uri, parent_id, f"{failed} of {ending.trials} trials unfinished")
        return failed, True
    _client(uri).log_metric(parent_id, "trials_failed", failed)
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
               resume_dir: str | None) -> tuple[str, dict[int, str], list[int]]:
    """The parent and child runs: new ones (recorded in `run.resume_dir` when set), or those of the sweep recorded
    there, reopened. Returns (parent id, {trial index: child id}, indices of the trials to run: all of a new
    sweep; a continued sweep's trials whose child run has not finished)."""
    valid = [t for t in trials if t.cfg is not None]
    recorded = resume.recorded_sweep(resume_dir)
    if recorded is None:
        parent_id = start_parent(uri, spec, trials, cluster)
        for data_path in {t.cfg.data.path for t in valid}:  # lineage, as a training run logs it
            tracking.log_data_files(uri, parent_id, data_path, read_manifest(data_path))
        children = start_children(uri, parent_id, valid)
        resume.record_sweep(resume_dir, parent_id, children)
        return parent_id, children, [t.index for t in valid]
    parent_id, children = recorded
    tracking.reopen_run(uri, parent_id)
    to_run = []
    for index, run_id in children.items():
        if tracking.reopen_run(uri, run_id) != "FINISHED":
            to_run.append(index)
            if "sweep.not_finished" in _client(uri).get_run(run_id).data.tags:  # said by the stopped attempt
                _client(uri).delete_tag(run_id, "sweep.not_finished")
    return parent_id, children, to_run


def run_sweep(spec: DictConfig, trials: list[Trial], uri: str, resume_dir: str | None) -> tuple[str, int, bool]:
    """Ray, parent run, children, Tune, report. Returns (parent run id, number of failed trials, whether the
    sweep stopped on request with trials left to continue)."""
    import ray

    cpus, gpus = start_ray(trials)
    parent_id = None
    pending: dict[int, str] = {}  # the child runs this attempt runs
    outcomes: dict[int, Outcome] = {}
    try:
        reject_unfit(trials, cpus, gpus)
        valid = [t for t in trials if t.cfg is not None]
        concurrency = max_concurrent(valid, cpus, gpus, spec.max_concurrent_trials) if valid else 0
        cluster = {"cpus": cpus, "gpus": gpus, "nodes": len(ray.nodes()), "max_concurrent_trials": concurrency}
        parent_id, children, to_run = open_sweep(uri, spec, trials, cluster, resume_dir)
        print(f"MLflow parent run {parent_id} ({uri}); {len(valid)} trials, {len(trials) - len(valid)} rejected, "
              f"{concurrency} at a time{f', {len(to_run)} left to run' if len(to_run) < len(children) else ''}",
              flush=True)
        print(rejected_text(trials), flush=True)
        if not valid:
            raise RuntimeError("no trial fits the cluster")
        pending = {i: children[i] for i in to_run}
        runnable = [t for t in valid if t.index in pending]
        outcomes = run_tune(spec, runnable, children, uri, parent_id, concurrency) if runnable else {}
        outcomes.update({i: Outcome("KILLED", "does not fit this cluster") for i in pending if i not in outcomes})
        ending = SweepEnding(parent_id, uri, OmegaConf.to_container(spec, resolve=True), pending, outcomes,
                             len(children), resume.stop_requested(resume_dir), valid[0].cfg.run.register_model,
                             valid[0].cfg.run.storage_path)
        failed, stopped = finish_sweep(ending)
        return parent_id, failed, stopped
    except SweepTrackingDown:
        raise  # the trials ended; what is left to tell MLflow waits in the parent's spool folder
    except BaseException as err:  # KeyboardInterrupt too: no run may stay RUNNING
        if parent_id is None:
            raise
        close_children(uri, {i: r for i, r in pending.items() if i not in outcomes}, outcomes)
        tracking.end_unfinished_run(uri, parent_id, err)
        raise SweepFailed(parent_id, err) from err
    finally:
        shutdown_ray()


class SweepFailed(RuntimeError):
    def __init__(self, parent_id: str, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.parent_id = parent_id


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec, trials, uri, resume_dir = validate(argv)
    except (ConfigError, DataError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    resume.raise_on_sigterm()
    try:
        parent_id, failed, stopped = run_sweep(spec, trials, uri, resume_dir)
    except SweepTrackingDown as err:
        print(f"error: {err}", file=sys.stderr)
        print(f"mlflow_parent_run_id={err.parent_id}", flush=True)
        return 1
    except SweepFailed as err:
        how = resume.interruption(err.__cause__)
        print(f"error: interrupted ({how}); the MLflow parent run is KILLED" if how else f"error: sweep failed: {err}",
              file=sys.stderr)
        print(f"mlflow_parent_run_id={err.parent_id}", flush=True)
        return 1
    if stopped:
        print(f"stopped on request with {failed} trial(s) unfinished: delete {resume.stop_file(resume_dir)} and "
              f"run again with run.resume_dir={resume_dir} to continue", file=sys.stderr)
        print(f"mlflow_parent_run_id={parent_id}", flush=True)
        return resume.EXIT_PREEMPTED
    if failed:
        print(f"error: {failed} trial(s) did not finish", file=sys.stderr)
    print(f"mlflow_parent_run_id={parent_id}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
