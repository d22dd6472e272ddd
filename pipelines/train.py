"""Train one model: `rtp train [trainer=ddp] [data=mnist] [model=mlp] [key=value ...]` (or `python -m
pipelines.train ...`).

What `ray job submit` runs. Uses the cluster at RAY_ADDRESS when set, else starts a local Ray.
Last stdout line: `mlflow_run_id=<id>`. Exit codes: see EXIT_CODES.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

from omegaconf import DictConfig, OmegaConf

from contract import resume, tracking
from contract.config import at_world_size, layout_of, monitor_of, worker_resources
from contract.console import one_line, say
from contract.metrics import FINAL_MODEL_TEST
from contract.startup import DRIVER_BEFORE_RUN, started_at
from pipelines.checks import check_run_folders
from pipelines.config import ConfigError, check_fits_this_machine, flatten, load_config, parallel_params
from pipelines.data.idx import DataError
from pipelines.data.shards import dataset_refs, read_manifest, shard_paths
from pipelines.fit import fit_backend, fit_still_running, init_ray
from pipelines.goodput import log_goodput
from pipelines.help import training_help, wants_help
from pipelines.ray_session import ray_address_problem, shutdown_ray
from pipelines.summary import run_summary

SUMMARY = """Train one model with a backend (trainer=...) on a prepared dataset (data=..., data.path=...), on the Ray
cluster at RAY_ADDRESS or a local Ray of its own, logged to MLflow (MLFLOW_TRACKING_URI, else the project's sqlite
store). Last line: mlflow_run_id=<id>."""
EXIT_CODES = ("0 finished; 1 training failed (the MLflow run is FAILED, with the error) or was interrupted (Ctrl-C, "
              "SIGTERM: the run is KILLED, tag `interrupted`); 2 bad config, data or tracking server (nothing was "
              "started); 3 stopped on request with a checkpoint (`run.resume_dir`; the run is KILLED until continued)")
EXAMPLES = ["rtp train trainer=fsdp model=cnn trainer.epochs=3 data.path=data/mnist/parquet",
            "ray job submit --working-dir . -- rtp train trainer.num_workers=4 data.path=/shared/mnist/parquet"]


def validate(argv: list[str]) -> tuple[DictConfig, dict, str]:
    """Everything that can be checked before taking cluster resources."""
    cfg = load_config(argv)
    check_fits_this_machine(cfg)
    check_run_folders(cfg.run)
    manifest = read_manifest(cfg.data.path)  # every shard present, readable and of the manifest's size
    for split in ("train", cfg.data.eval_split):
        shard_paths(cfg.data.path, manifest, split)
    if problem := ray_address_problem():
        raise ConfigError(problem)
    uri = tracking.tracking_uri()
    tracking.check_reachable(uri)
    try:
        tracking.check_experiment(uri, cfg.run.experiment)
        if (recorded := resume.recorded_run_id(cfg.run.resume_dir)) is not None:
            tracking.check_recorded_run(uri, cfg.run.resume_dir, recorded)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg, manifest, uri


def check_cluster_fits(cfg: DictConfig) -> None:
    """The whole Ray cluster can hold the run's workers (Ray Train would otherwise wait for them forever): an
    elastic run's fewest, `trainer.min_workers`."""
    import ray

    trainer = cfg.trainer
    fewest = at_world_size(cfg, trainer.min_workers).trainer if trainer.min_workers else trainer
    total = ray.cluster_resources()
    cpus, gpus = worker_resources(fewest)
    if cpus > total.get("CPU", 0) or gpus > total.get("GPU", 0):
        key = "trainer.min_workers" if trainer.min_workers else "trainer.num_workers"
        raise ConfigError(f"{key}: {fewest.num_workers} workers need {cpus} CPUs and {gpus} GPUs, "
                          f"the Ray cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs")
    nodes, workers = len([node for node in ray.nodes() if node["Alive"]]), layout_of(fewest).ray_workers
    if trainer.placement_strategy == "STRICT_SPREAD" and workers > nodes:
        what = "workers" if workers == fewest.num_workers else "Ray workers (the chief, parameter servers, workers)"
        raise ConfigError(f"trainer.placement_strategy: STRICT_SPREAD puts each of the {workers} {what} on its own "
                          f"node, the Ray cluster has {nodes}")


def run_training(cfg: DictConfig, uri: str, run_id: str, first_attempt: bool = True) -> str | None:
    """Fit the backend's trainer on the connected Ray and log the final model (pipelines/fit.py). Returns None when
    the run finished, else (it stopped on request, `run.resume_dir`, with a checkpoint) the line saying how to
    continue it."""
    import ray

    if first_attempt:  # params are write-once in MLflow; a resumed run may land on another cluster
        resources = ray.cluster_resources()
        tracking.log_params(uri, run_id, {"cluster.cpus": resources.get("CPU", 0),
                                          "cluster.gpus": resources.get("GPU", 0),
                                          "cluster.nodes": len(ray.nodes())})
    stopped = fit_backend(cfg, run_id, uri)
    if stopped is None:
        score_held_out_test(cfg, uri, run_id)
        figures = log_goodput(uri, run_id)
        say(f"goodput {figures['goodput']:.2f}: training {figures['goodput.training_s']:.0f} s of "
            f"{figures['goodput.wall_s']:.0f} s (start-up {figures['goodput.startup_s']:.0f} s, "
            f"checkpoints inside epochs {figures['goodput.checkpoint_s']:.0f} s, epoch ends "
            f"{figures['goodput.epoch_end_s']:.0f} s, final model {figures['goodput.final_s']:.0f} s, the rest "
            f"{figures['goodput.other_s']:.0f} s)")
        return None
    folder = tracking.spool_dir(cfg.run.storage_path, run_id)
    away = "" if tracking.mark_preempted(uri, run_id, stopped, folder) else (
        f"; the MLflow tracking server {uri} did not answer, so the run shows RUNNING until it is continued "
        f"(its stop point waits in {folder})")
    return (f"stopped on request with a checkpoint{away}: delete {resume.stop_file(cfg.run.resume_dir)} and run "
            f"again with run.resume_dir={cfg.run.resume_dir} to continue")


def score_held_out_test(cfg: DictConfig, uri: str, run_id: str) -> None:
    """The chosen model (`run.final_model`) scored once on the test split, which model selection never saw (the
    epochs were evaluated on the validation split): `final_test_*` metrics. A sweep's trials are not scored: a
    sweep picks among them, so only the model it picks should meet the test split (`rtp evaluate`)."""
    from pipelines.data import data_schema
    from pipelines.data.shards import read_manifest
    from pipelines.scoring import held_out_test_metrics

    schema = data_schema({"dataset": cfg.data.name, **read_manifest(cfg.data.path)})
    began = time.monotonic()
    if held_out_test_metrics(uri, run_id, cfg.data.path, cfg.data.eval_split, schema):  # the summary shows them
        tracking.log_metrics(uri, run_id, {FINAL_MODEL_TEST: time.monotonic() - began})


def close_failed_run(uri: str, run_id: str, err: BaseException, what: str = "training") -> str:
    """Mark the run KILLED (an interrupt, tag `interrupted`) or FAILED (with the error); returns the one error
    line to print, which also says when the tracking server could not be told."""
    how = resume.interruption(err)
    status = "KILLED" if how else "FAILED"
    try:
        with resume.interrupts_ignored():  # a second Ctrl-C or SIGTERM would leave the run RUNNING
            tracking.end_unfinished_run(uri, run_id, err)
        outcome = f"the MLflow run is {status}"
    except Exception as mark_err:  # the tracking server went away as well
        outcome = f"the MLflow run could not be marked {status} ({type(mark_err).__name__})"
    if how:
        return f"error: interrupted ({how}); {outcome}"
    whole = " (its traceback: the run's error.txt)" if "\n" in str(err).strip() else ""
    return f"error: {what} failed: {one_line(err)}{whole}; {outcome}"


def open_run(cfg: DictConfig, manifest: dict, uri: str) -> tuple[str, str | None]:
    """The MLflow run to train into: the one recorded in `run.resume_dir` if there is one, else a new one.
    Returns (run id, status the run had before, None if new)."""
    run_id = resume.recorded_run_id(cfg.run.resume_dir)
    if run_id is not None:
        status = tracking.reopen_run(uri, run_id)
        reopened = status != "FINISHED"  # RUNNING again: ended if this attempt fails here
        with tracking.ended_on_error(uri, run_id) if reopened else contextlib.nullcontext():
            if reopened:
                tracking.log_attempt_changes(uri, run_id, {**flatten(cfg), **parallel_params(cfg)})
            # what an attempt the server did not hear left behind (its stop point, say) goes first, in order
            tracking.flush_spools(uri, run_id, tracking.spool_dir(cfg.run.storage_path, run_id))
        return run_id, status
    run_name = cfg.run.name or f"{cfg.trainer.backend}-{cfg.data.name}-{cfg.model.name}"
    created = time.time()
    run_id = tracking.start_run(uri, cfg.run.experiment, run_name, {**flatten(cfg), **parallel_params(cfg)},
                                OmegaConf.to_yaml(cfg))
    with tracking.ended_on_error(uri, run_id):  # not yet recorded: a failure here ends it, a rerun starts anew
        tracking.log_metrics(uri, run_id, {DRIVER_BEFORE_RUN: created - started_at()})  # for its goodput
        tracking.log_data_files(uri, run_id, cfg.data.path, manifest)
        tracking.log_dataset_inputs(uri, run_id, dataset_refs(cfg.data.path, manifest,
                                                              {"training": "train", "eval": cfg.data.eval_split}))
        resume.record_run_id(cfg.run.resume_dir, run_id)
    return run_id, None


def main(argv: list[str] | None = None) -> int:
    began = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(training_help("rtp train [GROUP=CHOICE ...] [KEY=VALUE ...]", SUMMARY, argv, EXIT_CODES, EXAMPLES))
        return 0
    try:
        cfg, manifest, uri = validate(argv)
    except (ConfigError, DataError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    needed = cfg.trainer.num_workers * cfg.trainer.threads_per_worker + 2  # +2: Ray Data readers
    init_ray(max(os.cpu_count() or 1, needed), cfg.run.verbose)  # a local Ray's CPUs, if it starts one
    try:
        check_cluster_fits(cfg)
    except ConfigError as err:
        shutdown_ray()
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        code, run_id, message = train_into_run(cfg, manifest, uri)
    except BaseException:
        shutdown_ray()
        raise
    summary = run_summary(uri, run_id, monitor_of(cfg.run), cfg.data.eval_split,
                          str(tracking.run_dir(cfg.run.storage_path, run_id).absolute()), time.monotonic() - began)
    if fit_still_running():  # interrupted: say it before the shutdown, which may end this process
        report_end(summary, message, run_id)
        shutdown_ray()
    else:
        # After the shutdown, so that they are the last lines: Ray's thread that forwards the workers' logs can
        # no longer write after them, or into the middle of them.
        shutdown_ray()
        report_end(summary, message, run_id)
    return code


def report_end(summary: list[str], message: str | None, run_id: str) -> None:
    """The run's last lines: the summary block, its one error or stop line (stderr), then `mlflow_run_id=`
    (stdout, the line scripts read)."""
    print("\n".join(summary), flush=True)
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.write(f"mlflow_run_id={run_id}\n")
    sys.stdout.flush()


def train_into_run(cfg: DictConfig, manifest: dict, uri: str) -> tuple[int, str, str | None]:
    """Open (or continue) the MLflow run and train into it on the connected Ray; returns (exit code, run id, the
    one line to end stderr with, if any)."""
    tracking.close_orphaned_runs(uri, cfg.run.experiment)
    run_id, previous_status = open_run(cfg, manifest, uri)
    if previous_status == "FINISHED":
        print(f"MLflow run {run_id} recorded in {cfg.run.resume_dir} has already finished; nothing to do")
        return 0, run_id, None
    print(f"MLflow run {run_id} ({uri}){' continued' if previous_status else ''}", flush=True)
    resume.raise_on_sigterm()  # after Ray's start (`main`), whose own SIGTERM handler would end the process at once
    try:
        tracking.log_cluster_startup(uri, run_id)
        stopped = run_training(cfg, uri, run_id, first_attempt=previous_status is None)
        if stopped is None:
            tracking.end_run(uri, run_id)
    except tracking.TrackingDown as err:  # trained; the server cannot hear it: nothing to mark the run with
        return 1, run_id, f"error: {err}"
    except BaseException as err:  # interrupts too: the run must not stay RUNNING
        return 1, run_id, close_failed_run(uri, run_id, err)
    if stopped is not None:
        return resume.EXIT_PREEMPTED, run_id, stopped
    return 0, run_id, None


if __name__ == "__main__":
    sys.exit(main())
