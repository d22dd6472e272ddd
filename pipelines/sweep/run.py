"""Sweep parallelism degrees with Ray Tune: `rtp sweep sweep=parallelism [overrides]` (or `python -m
pipelines.sweep ...`).

Arguments: `sweep=<name>` picks `conf/sweep/<name>.yaml`, `sweep.key=value` overrides it, anything else is a
training override applied to every trial (e.g. `data.path=...`, `trainer.epochs=2`). What `ray job submit`
runs; uses the cluster at RAY_ADDRESS when set, else starts a local Ray.

Each grid point is validated like a training run; impossible ones are rejected before launch and logged to the
parent MLflow run (`rejected.json`, `rejected.csv`, metric `trials_rejected`). Each valid point is one Tune
trial, in a child MLflow run created here (tag `mlflow.parentRunId`), whose function builds and fits the
backend's Ray Train trainer and reports its epochs to Tune (pipelines/sweep/trial.py). The scheduler is FIFO,
ASHA or PBT (pipelines/sweep/pbt.py). The scaling report (Markdown, CSV, plots) is built from the child runs at
the end and logged to the parent run.

Last stdout line: `mlflow_parent_run_id=<id>`. Exit codes: EXIT_CODES.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from contract import resume, tracking
from contract.console import one_line
from contract.metrics import REPORTED_EPOCH
from contract.registry import plugin_roots
from pipelines.checks import check_run_folders
from pipelines.config import CONF_DIR, ConfigError, check_fits_this_machine, group_choices
from pipelines.data.idx import DataError
from pipelines.data.shards import read_manifest, shard_paths
from pipelines.fit import init_ray, stopped_at
from pipelines.help import exit_codes_text, first_comment, format_rows, key_table, wants_help
from pipelines.ray_session import ray_address_problem, shutdown_ray
from pipelines.summary import sweep_summary
from pipelines.sweep.pbt import PBT_CHECKPOINTS_KEPT, check_mutated_trials, make_pbt, mutations, param_space
from pipelines.sweep.runs import (Outcome, SweepEnding, SweepTrackingDown, child_specs, children_of, close_children,
                                  finish_sweep, open_sweep, recorded_children, still_running, trials_folder)
from pipelines.sweep.space import (SweepConfig, Trial, cpus_needed, load_sweep, max_concurrent, plan_trials,
                                   reject_ignored, reject_unfit, split_argv, stop_thresholds)


def validate(argv: list[str]) -> tuple[DictConfig, list[Trial], str, str | None]:
    """Everything that can be checked before taking cluster resources. Returns (sweep spec, trials, tracking URI,
    `run.resume_dir`)."""
    name, sweep_overrides, train_overrides = split_argv(argv)
    spec = load_sweep(name, sweep_overrides)
    mutable = mutations(spec)
    trials = plan_trials(spec, train_overrides)
    check_mutated_trials(spec, trials, mutable)
    reject_ignored(trials, list(mutable))
    for trial in trials:
        try:
            if trial.cfg is not None:
                check_fits_this_machine(trial.cfg)
        except ConfigError as err:
            trial.cfg, trial.reason = None, str(err)
    valid = [t for t in trials if t.cfg is not None]
    if not valid:
        raise no_valid_trial(trials, "")
    for data_path, split in {(t.cfg.data.path, t.cfg.data.eval_split) for t in valid}:
        manifest = read_manifest(data_path)
        for each in ("train", split):
            shard_paths(data_path, manifest, each)
    check_run_folders(valid[0].cfg.run)  # `run` keys: the same for every trial
    resume_dir = valid[0].cfg.run.resume_dir
    recorded = resume.recorded_sweep(resume_dir)
    # Its trials: those that opened a child run (a sweep ended by SIGKILL recorded none in `resume_dir` yet)
    started = set(recorded[1]) | set(recorded_children(trials_folder(valid[0].cfg.run.storage_path, recorded[0]))) \
        if recorded else set()
    missing = sorted(started - {t.index for t in valid})
    untold = tracking.spool_dir(valid[0].cfg.run.storage_path, recorded[0]) if recorded else None
    if untold is not None and (untold / tracking.SWEEP_FILE).is_file():
        raise ConfigError(f"run.resume_dir: MLflow has not heard how the last attempt of the sweep recorded in "
                          f"{resume_dir} ended; run `rtp replay {untold}` first")
    if missing:
        raise ConfigError(f"run.resume_dir: the sweep recorded in {resume_dir} has trials this grid lacks "
                          f"({missing}); continue it with the same sweep and overrides, or use another run.resume_dir")
    if problem := ray_address_problem():
        raise ConfigError(problem)
    uri = tracking.tracking_uri()
    tracking.check_reachable(uri)
    try:
        tracking.check_experiment(uri, valid[0].cfg.run.experiment)
        if recorded:
            tracking.check_recorded_run(uri, resume_dir, recorded[0])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return spec, trials, uri, resume_dir


def rejected_text(trials: list[Trial]) -> str:
    """A line per rejected point; points rejected for the same reason (a data path every point shares) share one."""
    reasons: dict[str, list[Trial]] = {}
    for trial in trials:
        if trial.cfg is None:
            reasons.setdefault(trial.reason, []).append(trial)
    return "\n".join(f"  rejected #{points[0].index} {points[0].combo}: {reason}" if len(points) == 1 else
                     f"  rejected {len(points)} points (#{', #'.join(str(t.index) for t in points)}): {reason}"
                     for reason, points in reasons.items())


def no_valid_trial(trials: list[Trial], where: str) -> ConfigError:
    """The sweep's refusal when every point was rejected: in one line when they share one reason."""
    text = rejected_text(trials)
    if "\n" not in text and all(t.cfg is None for t in trials):
        return ConfigError(f"sweep.grid: no valid trial{where}: every point ({len(trials)}) rejected: "
                           f"{trials[0].reason}")
    return ConfigError(f"sweep.grid: no valid trial{where}:\n{text}")


def start_ray(trials: list[Trial]) -> tuple[float, float]:
    """Connect (RAY_ADDRESS) or start a local Ray sized for the largest trial; returns (CPUs, GPUs). A trial that
    Tune stops early (ASHA) relies on Ray Train's placement-group cleaner to free its workers' resources for the
    next trials, which `init_ray` lets it find."""
    import ray

    valid = [cpus_needed(t.cfg) for t in trials if t.cfg is not None]
    verbose = any(t.cfg.run.verbose for t in trials if t.cfg is not None)
    init_ray(max(os.cpu_count() or 1, int(max(valid, default=1))), verbose)
    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


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


def run_tune(spec: DictConfig, valid: list[Trial], uri: str, parent_id: str, concurrency: int) -> dict[int, Outcome]:
    """Run every valid trial; returns {trial index: how it ended}."""
    from ray import tune

    from pipelines.sweep.trial import run_trial  # imports Ray Train: not before the config is checked

    mutable = mutations(spec)
    children = child_specs(parent_id, valid)
    folder = str(trials_folder(valid[0].cfg.run.storage_path, parent_id))
    specs = {t.index: {"cfg": trial_config(t.cfg), "child": children[t.index], "trials_folder": folder,
                       "tracking_uri": uri, "plugin_roots": plugin_roots(t.cfg.plugins), "mutable": list(mutable),
                       "tune_checkpoints": spec.scheduler == "pbt"} for t in valid}
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
    # Tune's own SIGINT handler ends the trials and returns as if they had failed: the sweep would end FAILED. Without
    # it Ctrl-C interrupts fit here, and run_sweep marks the trials and the parent KILLED (`interrupted`).
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
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


def run_sweep(spec: DictConfig, trials: list[Trial], uri: str, resume_dir: str | None) -> tuple[str, int, bool]:
    """Ray, parent run, children, Tune, report. Returns (parent run id, number of failed trials, whether the
    sweep stopped on request with trials left to continue)."""
    import ray

    cpus, gpus = start_ray(trials)
    resume.raise_on_sigterm()  # after Ray's start, whose own SIGTERM handler would end the process at once
    parent_id = None
    to_run: list[int] = []  # the trials this attempt runs
    outcomes: dict[int, Outcome] = {}
    try:
        reject_unfit(trials, cpus, gpus)
        valid = [t for t in trials if t.cfg is not None]
        if not valid:  # before the parent run: nothing to log
            raise no_valid_trial(trials, f" on this Ray cluster ({cpus:g} CPUs, {gpus:g} GPUs)")
        concurrency = max_concurrent(valid, cpus, gpus, spec.max_concurrent_trials)
        cluster = {"cpus": cpus, "gpus": gpus, "nodes": len(ray.nodes()), "max_concurrent_trials": concurrency}
        parent_id, to_run = open_sweep(uri, spec, trials, cluster, resume_dir)
        print(f"MLflow parent run {parent_id} ({uri}); {len(valid)} trials, {len(trials) - len(valid)} rejected, "
              f"{concurrency} at a time{f', {len(to_run)} left to run' if len(to_run) < len(valid) else ''}",
              flush=True)
        print(rejected_text(trials), flush=True)
        runnable = [t for t in valid if t.index in to_run]
        outcomes = run_tune(spec, runnable, uri, parent_id, concurrency) if runnable else {}
        outcomes.update({i: Outcome("KILLED", "does not fit this cluster") for i in to_run if i not in outcomes})
        pending, ends = children_of(uri, parent_id, valid, to_run, resume_dir)
        ending = SweepEnding(parent_id, uri, OmegaConf.to_container(spec, resolve=True), pending, outcomes,
                             len(valid), resume.stop_requested(resume_dir), valid[0].cfg.run.register_model,
                             valid[0].cfg.run.storage_path, ends)
        failed, stopped = finish_sweep(ending)
        return parent_id, failed, stopped
    except SweepTrackingDown:
        raise  # the trials ended; what is left to tell MLflow waits in the parent's spool folder
    except BaseException as err:  # KeyboardInterrupt too: no run may stay RUNNING
        if parent_id is None:
            raise
        with resume.interrupts_ignored():  # a second Ctrl-C or SIGTERM would leave runs RUNNING
            try:  # the children the sweep had not ended yet (it may fail while ending them), then the parent
                if to_run:
                    pending, ends = children_of(uri, parent_id, valid, to_run, resume_dir)
                    close_children(uri, still_running(uri, pending), outcomes, ends)
            finally:
                tracking.end_unfinished_run(uri, parent_id, err)
        raise SweepFailed(parent_id, err) from err
    finally:
        shutdown_ray()


class SweepFailed(RuntimeError):
    def __init__(self, parent_id: str, cause: BaseException):
        super().__init__(one_line(cause))
        self.parent_id = parent_id


EXIT_CODES = ("0 every trial finished (ASHA's early stops count as finished); 1 a trial failed or never completed an "
              "epoch, or the sweep failed (the report still covers the trials that ran), or the tracking server was "
              "away when the trials ended (`rtp replay` then finishes it); 2 bad config, data or tracking server, or "
              "no valid trial (nothing was started); 3 stopped on request (`run.resume_dir` holds STOP): the "
              "unfinished trials checkpointed, the parent run is KILLED, and a rerun with the same `run.resume_dir` "
              "continues the same parent and re-runs only the unfinished trials, each from its checkpoint")


def sweep_help(argv: list[str]) -> str:
    """The presets, then the chosen preset's sweep keys with their values and meaning."""
    name, _, _ = split_argv(argv)
    width = 2 + max(map(len, group_choices("sweep")))
    presets = "\n".join(f"  {preset:<{width}}{first_comment(CONF_DIR / 'sweep' / f'{preset}.yaml')}"
                        for preset in group_choices("sweep"))
    try:
        keys = format_rows(key_table(OmegaConf.create({"sweep": load_sweep(name, [])}), {"sweep": SweepConfig}))
    except ConfigError as err:
        keys = f"  ({err})"
    return "\n\n".join([
        "usage: rtp sweep [sweep=PRESET|sweep=FILE.yaml] [sweep.KEY=VALUE ...] [training KEY=VALUE ...]",
        "Run a grid (or search space) of training runs as Ray Tune trials, each an MLflow child run of the sweep's "
        "run,\nthen log a scaling report. Every valid point is validated like `rtp train` before anything starts; "
        "impossible\nones are rejected and logged. Training overrides (`rtp train --help`) apply to every trial.",
        f"sweep presets (sweep=PRESET, default parallelism; or sweep=FILE.yaml, a file of these keys):\n{presets}",
        f"keys of sweep={name} (sweep.KEY=VALUE overrides one):\n{keys}",
        exit_codes_text(EXIT_CODES),
        "examples:\n  rtp sweep sweep=smoke data.path=data/imdb/parquet\n"
        "  rtp sweep sweep=pbt_mnist sweep.num_samples=2 data.path=data/mnist/parquet"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(sweep_help(argv))
        return 0
    try:
        spec, trials, uri, resume_dir = validate(argv)
    except (ConfigError, DataError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    began = time.monotonic()
    try:
        parent_id, failed, stopped = run_sweep(spec, trials, uri, resume_dir)
    except ConfigError as err:  # no trial fits the connected cluster: nothing was started in MLflow
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SweepTrackingDown as err:
        return end_sweep(f"error: {err}", err.parent_id, 1)
    except SweepFailed as err:
        how = resume.interruption(err.__cause__)
        print("\n".join(sweep_summary(uri, err.parent_id, spec.metric, time.monotonic() - began)), flush=True)
        return end_sweep(f"error: interrupted ({how}); the MLflow parent run is KILLED" if how
                         else f"error: sweep failed: {err}", err.parent_id, 1)
    print("\n".join(sweep_summary(uri, parent_id, spec.metric, time.monotonic() - began)), flush=True)
    if stopped:
        return end_sweep(f"stopped on request with {failed} trial(s) unfinished: delete {resume.stop_file(resume_dir)} "
                         f"and run again with run.resume_dir={resume_dir} to continue", parent_id,
                         resume.EXIT_PREEMPTED)
    return end_sweep(f"error: {failed} trial(s) did not finish" if failed else None, parent_id, 1 if failed else 0)


def end_sweep(message: str | None, parent_id: str, code: int) -> int:
    """The sweep's last lines: its one error or stop line (stderr), then `mlflow_parent_run_id=` (stdout, the
    line scripts read). Returns `code`."""
    if message:
        print(message, file=sys.stderr, flush=True)
    print(f"mlflow_parent_run_id={parent_id}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
