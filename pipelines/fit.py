"""Fit one backend's trainer on the prepared data and log its final model: the one path a training run
(`pipelines.train`) and every sweep trial (`pipelines.sweep`) take."""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from contract import tracking
from contract.checkpoint import BEST_CHECKPOINT, STATE_FILE, TrainState
from contract.config import typed_config, worker_resources
from contract.console import quiet_ray_env, quiet_ray_logs, ray_init_logging, say
from contract.data import DataSchema
from contract.files import write_atomically
from contract.hang import HANG_DIR, PROGRESS_DIR, read_verdicts
from contract.metrics import DIVERGED_FILE, DIVERGED_METRICS, FINAL_MODEL_LOG, STOP_METRICS
from contract.registry import plugin_roots
from pipelines.data import data_schema
from pipelines.data.shards import read_manifest
from pipelines.ray_session import start_local_ray
from trainers.preflight import LEFT_OUT_FILE, PREFLIGHT_FILE, PreflightFailed, read_left_out
from trainers.worker import placement_patience


def init_ray(num_cpus: int, verbose: bool = False) -> None:
    """Connect to the cluster at RAY_ADDRESS, or start our own local Ray with `num_cpus` (never some other cluster on
    this machine by accident; loopback only, with a token: `start_local_ray`), and tell the job's processes which
    cluster is theirs. Ray Train's placement-group cleaner (a detached actor) asks Ray's State API whether the run's
    controller lives; without RAY_ADDRESS or RAY_API_SERVER_ADDRESS it looks for "the" cluster in
    /tmp/ray/ray_current_cluster, which the last `ray start` without `--temp-dir` on this machine wrote: a head long
    gone (the cleaner's thread then dies with a traceback, and cleans nothing), or another live cluster, which does
    not know our controller, so the cleaner removes our workers' placement group mid-run. Unless `verbose`
    (`run.verbose`), Ray's INFO lines stay in its log files, off the console (contract/console.py)."""
    quiet = quiet_ray_env(verbose)
    if not verbose:
        quiet_ray_logs()
    if address := os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": {"RAY_ADDRESS": address, **quiet}},
                 **ray_init_logging(verbose))
        return
    # The dashboard serves the State API: on, at a port chosen here so that the job's processes can be told it.
    port = _free_port()
    start_local_ray(num_cpus=num_cpus, dashboard_host="127.0.0.1", dashboard_port=port,
                    runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}", **quiet}},
                    **ray_init_logging(verbose))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fit_backend(cfg: DictConfig, run_id: str, uri: str, callbacks: list | None = None) -> str | None:
    """Build the backend's Ray Train trainer over the Parquet shards, fit it, and log the final model to the MLflow
    run. Returns where the run stopped ("epoch E step S") when it stopped on request (no model is logged then:
    the checkpoint holds a half-done epoch), else None. `callbacks`: e.g. a sweep trial's TrialReporter."""
    from pipelines.data.readers import Materializing, parquet_datasets, within

    # Each step of the driver's Ray Data work waits for free CPUs at most `fault.resource_timeout_s`, as the workers do.
    patience = cfg.fault.resource_timeout_s or None
    datasets = within(patience, "list the shards", lambda: parquet_datasets(
        cfg.data.path, {"train": "train", "eval": cfg.data.eval_split}, cfg.run.progress))
    # Workers that cache their shard get it by an ordered split, which materialises the datasets anyway: start
    # that now (data too large to cache streams instead, and stays lazy).
    materialized = Materializing(datasets) if cfg.data.cache_in_worker else None
    from trainers import get_backend  # imports the backend's framework (seconds for torch) while the data is read

    backend = get_backend(cfg.trainer)
    inputs = data_schema(read_manifest(cfg.data.path))
    if materialized is not None:
        datasets = materialized.result(patience)
    elif backend.streams_files:  # its workers read the files through Ray Data themselves (trainers/streamed.py)
        datasets = {}
    placement_wait, _ = placement_patience(cfg)
    if placement_wait is not None:  # read by Ray Train's controller (trainers/worker.py: run_config)
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(placement_wait)
    # Ray Train's preemption watcher (an actor per run, CPU time to start) polls Ray for nodes being drained
    # (cloud autoscalers) and tells `ray.train.get_preemption_info`, which nothing here reads: a Slurm preemption
    # stops a run through its STOP file (contract/resume.py). Off unless the user turns it on.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # Ray Train's controller takes a worker's report, and sees a run's end or a worker's failure, only when it next
    # polls the workers: every 2 s by default. A worker's report queue holds one report, so one that reports again
    # before that poll waits for it: short epochs wait for the poll, and so does a run's end. Every 0.5 s, for a
    # little more of the controller's CPU (benchmarks/README.md "Run end"). A slow answer is no
    # failure (Ray Train gives a worker 10 min). Ray Train hands the variable on to its controller.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    run_folder = tracking.run_dir(cfg.run.storage_path, run_id)
    (run_folder / DIVERGED_FILE).unlink(missing_ok=True)  # an earlier attempt's, continued with a gentler recipe
    for earlier in (HANG_DIR, PROGRESS_DIR):  # the hang watchdog's, of an earlier job (already logged)
        shutil.rmtree(run_folder / earlier, ignore_errors=True)
    (run_folder / PREFLIGHT_FILE).unlink(missing_ok=True)
    (run_folder / LEFT_OUT_FILE).unlink(missing_ok=True)
    system = tracking.SystemMetrics(uri, run_id, "driver", cfg.run.system_metrics_interval_s) \
        if cfg.run.system_metrics else None
    try:
        result = fit_leaving_out(lambda: backend.build_trainer(cfg, datasets, run_id, uri, inputs, callbacks=callbacks))
    except Exception as err:
        waited, hung, preflight = resource_wait(err, cfg), log_hangs(uri, run_id, run_folder), preflight_failed(err)
        if waited or hung or preflight:
            raise RuntimeError(waited or hung or preflight) from None
        raise
    finally:
        if system is not None:
            system.stop()
        log_preflight(uri, run_id, run_folder)
        report_left_out(uri, run_id, run_folder)
    if (hung := log_hangs(uri, run_id, run_folder)) is not None:
        say(f"{hung}; Ray Train restarted the workers from the last checkpoint")
    diverged = run_folder / DIVERGED_FILE
    if (where := diverged_at(json.loads(diverged.read_text()) if diverged.is_file() else None)) is not None:
        last = result.checkpoint.path if result.checkpoint is not None else "none (the first epoch diverged)"
        raise TrainingDiverged(f"the loss is not a finite number from {where} on (run.nan_patience="
                               f"{cfg.run.nan_patience}); no model is logged; the last finite checkpoint: {last}; "
                               f"a lower trainer.lr or a trainer.grad_clip may help")
    if result.checkpoint is None:
        raise RuntimeError("training ended without a checkpoint")
    stopped = stopped_at(result.metrics)
    if stopped is None:
        checkpoint, epoch = final_checkpoint(result, cfg.run.final_model, cfg.run.resume_from)
        log_final_model(backend, cfg, run_id, uri, checkpoint, inputs, {"final_model_epoch": str(epoch)})
    return stopped


FIT_THREAD = "ray-train-fit"


def fit_still_running() -> bool:
    """Whether an interrupted `fit_in_thread` left its thread inside Ray Train: once Ray is shut down, that
    thread's next call into Ray ends the whole process ("The core worker has already been shutdown").
    Not `Thread.is_alive()`: when a signal interrupts the `join()` waiting on a thread, Python 3.11 marks that
    thread stopped although it runs on (threading.py, bpo-45274), so after Ctrl-C it always said False. A thread
    leaves `threading.enumerate()` only once its function has returned."""
    return any(thread.name == FIT_THREAD for thread in threading.enumerate())


def fit_in_thread(trainer: Any) -> Any:
    """`trainer.fit()` in a helper thread, so that Ctrl-C and SIGTERM interrupt this thread at once. On the main
    thread Ray Train installs a SIGINT handler that waits for its controller to abort, and the controller does not
    listen while it waits for the workers' resources (up to `fault.resource_timeout_s`): Ctrl-C there would do
    nothing for minutes. Interrupted here, the driver marks the run KILLED and shuts Ray down, which ends the
    controller and its workers with it."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # handed to the caller's thread as it is
            outcome["error"] = err

    thread = threading.Thread(target=fit, name=FIT_THREAD, daemon=True)
    thread.start()
    thread.join()  # a signal's exception (KeyboardInterrupt, resume.Interrupted) is raised here
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


MAX_FITS = 16  # fits of one run when the preflight leaves nodes out (each time one node at least)


def fit_leaving_out(build: Callable[[], Any]) -> Any:
    """`fit_in_thread` of the trainer `build` makes, and of a new one (the same Ray Train run, on the nodes left)
    each time the preflight left nodes out and Ray Train did not start the workers again itself: a run of a fixed
    size gives up on its first failed start (trainers/worker.py: placement_patience)."""
    for _ in range(MAX_FITS - 1):
        try:
            return fit_in_thread(build())
        except Exception as err:
            if not nodes_left_out(err):
                raise
            say("the preflight left nodes out; starting the workers again without them")
    return fit_in_thread(build())


def nodes_left_out(err: Exception) -> bool:
    """Whether `err` is Ray Train giving up after a start that the preflight failed, leaving nodes out."""
    from trainers.nodes_left_out import NodesLeftOut

    return isinstance(getattr(err, "controller_failure", None), NodesLeftOut)


def checkpoint_state(checkpoint: Any) -> TrainState:
    with checkpoint.as_directory() as directory:
        return TrainState.read(directory)


def final_checkpoint(result: Any, final_model: str, resumed_from: str | None = None) -> tuple[Any, int]:
    """The checkpoint whose model the run logs, and its epoch: the last epoch's, or (`run.final_model=best`) the
    best epoch's by `run.monitor`, which the loop records and trainers/keep_best.py keeps beside Ray Train's. A run
    started from another run's checkpoint (`resumed_from`) that never did better has its best epoch there: that
    checkpoint itself, or the best one kept beside it."""
    from ray.train import Checkpoint

    last = checkpoint_state(result.checkpoint)
    if final_model == "last" or last.best_epoch in (0, last.epoch):
        return result.checkpoint, last.epoch
    places = [Path(result.checkpoint.path).parent / BEST_CHECKPOINT]
    if resumed_from:
        places += [Path(resumed_from), Path(resumed_from).parent / BEST_CHECKPOINT]
    for place in places:
        if (place / STATE_FILE).is_file():
            state = TrainState.read(place)
            if state.epoch == last.best_epoch and state.partial is None:
                return Checkpoint(str(place)), last.best_epoch
    raise RuntimeError(f"the checkpoint of the best epoch ({last.best_epoch}) is not in {places[0]}; "
                       f"set run.final_model=last to log the last epoch's model")


def log_final_model(backend: Any, cfg: DictConfig, run_id: str, uri: str, checkpoint: Any, inputs: DataSchema,
                    tags: dict[str, str]) -> None:
    """Send what the workers spooled while the tracking server was away, then the final model and its `tags`.
    With the server still away, keep all of it in the spool folder (final.json names the checkpoint) and raise
    `TrackingDown`: `rtp replay` finishes the run later."""
    folder = tracking.spool_dir(cfg.run.storage_path, run_id)
    try:
        if not tracking.answers(uri):  # a quick check first: the client itself retries for minutes
            raise ConnectionError(f"{uri} does not answer")
        unsent = tracking.flush_spools(uri, run_id, folder)
        if unsent:
            raise ConnectionError(f"{unsent} spooled record(s) not accepted")
        tracking.set_tags(uri, run_id, tags)
        began = time.monotonic()
        backend.log_final_model(uri, run_id, cfg, checkpoint, inputs)
        if cfg.run.register_model:
            tracking.register_logged_model(uri, run_id, cfg.run.register_model)
        logged_s = time.monotonic() - began
    except Exception:
        if tracking.answers(uri):
            raise  # not the server: a real failure
        final = {"cfg": OmegaConf.to_container(cfg, resolve=True), "checkpoint": checkpoint.path,
                 "inputs": inputs.to_dict(), "plugin_roots": plugin_roots(cfg.plugins), "run_id": run_id, "uri": uri,
                 "tags": tags}
        write_atomically(folder / tracking.FINAL_FILE, json.dumps(final, indent=2))  # `rtp replay` reads it whole
        raise tracking.TrackingDown(uri, run_id, folder, tracking.spooled(folder)) from None
    # After the model is in: a server lost now must not send the run to `rtp replay`, which would log it again.
    tracking.log_metrics(uri, run_id, {FINAL_MODEL_LOG: logged_s})


def replay_run(folder: Path, uri: str | None = None) -> str:
    """Finish a run from its spool folder once the tracking server is back: send the spooled records (none twice)
    and, when `final.json` is there, log the final model from its checkpoint and end the run FINISHED. `uri`:
    the server to send to (it may have moved), else the one the run used. Returns the run id. Raises
    TrackingUnavailable, ValueError (nothing to replay), RuntimeError (the server refused records)."""
    from ray.train import Checkpoint
    from trainers import get_backend

    final = folder / tracking.FINAL_FILE
    files = [*tracking.spool_files(folder), final]
    recorded = next((json.loads(path.read_text()) for path in files if path.is_file()), None)
    if recorded is None:
        raise ValueError(f"{folder}: no spooled records (nothing to replay)")
    run_id = recorded["run_id"]
    uri = uri or recorded["uri"]
    tracking.check_reachable(uri)
    unsent = tracking.flush_spools(uri, run_id, folder)
    if unsent:
        raise RuntimeError(f"{unsent} record(s) were not accepted by {uri}; run the replay again")
    if final.is_file():
        spec = json.loads(final.read_text())
        cfg = typed_config(spec["cfg"], spec.get("plugin_roots", []))
        inputs = DataSchema.from_dict(spec["inputs"]) if "inputs" in spec else \
            data_schema({"dataset": cfg.data.name, "model_inputs": spec["model_inputs"]})  # older
        tracking.set_tags(uri, run_id, spec.get("tags", {}))
        get_backend(cfg.trainer).log_final_model(uri, run_id, cfg, Checkpoint(spec["checkpoint"]), inputs)
        if cfg.run.register_model:
            tracking.register_logged_model(uri, run_id, cfg.run.register_model)
        tracking.end_run(uri, run_id)
        final.unlink()
    return run_id


def log_hangs(uri: str, run_id: str, run_folder: Path) -> str | None:
    """The hang watchdog's verdicts and stacks of this fit's attempts (contract/hang.py), and NCCL's Flight
    Recorder dumps, into the MLflow run; the last verdict's line, or None when no attempt hung."""
    verdicts, folder = read_verdicts(run_folder), run_folder / HANG_DIR
    if folder.is_dir() and any(folder.iterdir()):  # stacks, verdicts, NCCL Flight Recorder dumps
        tracking.log_hangs(uri, run_id, folder, [v["line"] for v in verdicts])
    return verdicts[-1]["line"] if verdicts else None


def log_preflight(uri: str, run_id: str, run_folder: Path) -> None:
    """The preflight's measurements (trainers/preflight.py) of the fit's last attempt, if it ran, as the run's
    `preflight.*` metrics. Best effort: it runs while a failure may be on its way out, which it must not hide."""
    measured = run_folder / PREFLIGHT_FILE
    if not measured.is_file():
        return
    try:
        tracking.log_metrics(uri, run_id, json.loads(measured.read_text())["metrics"])
    except Exception as err:  # the server away: the measurements stay in the run's folder
        say(f"warning: the preflight's measurements were not logged ({type(err).__name__}); they are in {measured}")


LEFT_OUT_TAG = "preflight.left_out"


def report_left_out(uri: str, run_id: str, run_folder: Path) -> None:
    """The nodes the preflight left out (trainers/preflight.py), said on the console, in the run's tag
    `preflight.left_out`, and appended (one IP a line) to the file PIPELINE_LEFT_OUT_FILE names: the Slurm script
    leaves them out of the job when it requeues it. Best effort, as `log_preflight`."""
    left_out = read_left_out(run_folder)
    if not left_out:
        return
    ips = sorted({entry["node"] for entry in left_out})
    for entry in left_out:
        say(f"preflight left out node {entry['node']}: {entry['why']}")
    if listing := os.environ.get("PIPELINE_LEFT_OUT_FILE"):
        with open(listing, "a") as out:
            out.writelines(f"{ip}\n" for ip in ips)
    try:
        tracking.set_tags(uri, run_id, {LEFT_OUT_TAG: ",".join(ips)})
    except Exception as err:  # the server away: the console and the run's folder have them
        say(f"warning: the left-out nodes were not tagged ({type(err).__name__}); they are in {run_folder}")


def preflight_failed(err: Exception) -> str | None:
    """The preflight's one line when it failed the run (raised in Ray Train's controller), else None."""
    failure = getattr(err, "controller_failure", None)
    while failure is not None:
        if isinstance(failure, PreflightFailed):
            return str(failure)
        failure = failure.__cause__ or failure.__context__
    return None


def resource_wait(err: Exception, cfg: DictConfig) -> str | None:
    """The one-line reason when `err` is Ray Train giving up on starting the workers (`fault.resource_timeout_s`),
    naming what they needed and what the cluster has free now; else None."""
    import ray
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    if not isinstance(getattr(err, "controller_failure", None), WorkerGroupStartupTimeoutError):
        return None
    trainer, free = cfg.trainer, ray.available_resources()
    cpus, gpus = worker_resources(trainer)
    return (f"fault.resource_timeout_s: the Ray cluster did not free {cpus} CPUs and {gpus} GPUs for "
            f"{trainer.num_workers} workers within {cfg.fault.resource_timeout_s:g} s (free now: "
            f"{free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs); wait for other jobs, or raise the timeout "
            f"(0: wait forever)")


class TrainingDiverged(RuntimeError):
    """The workers' loss stopped being a number (trainers/loop.py); the run fails without a model."""


def diverged_at(metrics: Mapping[str, Any] | None) -> str | None:
    """"epoch E step S" (or "epoch E" for an epoch's mean loss) when a report carries the loop's divergence
    metrics (contract/metrics.py), else None."""
    if not metrics or DIVERGED_METRICS[0] not in metrics:
        return None
    epoch, step = (metrics[name] for name in DIVERGED_METRICS)
    return f"epoch {epoch:g} step {step:g}" if step else f"epoch {epoch:g}"


def stopped_at(metrics: Mapping[str, Any] | None) -> str | None:
    """"epoch E step S" when a report carries the loop's stop metrics (contract/metrics.py), else None."""
    if not metrics or not metrics.get(STOP_METRICS[0]):
        return None
    epoch, step = (metrics[name] for name in STOP_METRICS)
    return f"epoch {epoch:g} step {step:g}"
