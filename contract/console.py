"""The one-line messages the pipelines print, and how much of Ray's own logging is printed beside them."""
from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator


def say(line: str) -> None:
    """One line to stdout, in a Ray Train worker too. Not print(): Ray Train 2.60 replaces it in workers with one
    that, when a library has wrapped sys.stdout (ours are), writes the line and also logs it to stdout: each line
    showed twice in the driver's output."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def one_line(err: BaseException) -> str:
    """`Type: message` of an error on one line. A worker's failure (Ray Train's WorkerGroupError) carries each
    failed rank's traceback: it becomes the ranks and the traceback's last line, the error itself (a run keeps
    the whole text as its `error.txt`: contract/tracking/runs.py end_run)."""
    failures = getattr(err, "worker_failures", None)  # {rank: its exception}
    if failures:
        ranks = ", ".join(str(rank) for rank in sorted(failures))
        return f"{type(err).__name__} (rank {ranks}): {one_line(failures[min(failures)])}"
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return f"{type(err).__name__}: {lines[0] if lines else ''}"
    return lines[-1] if re.match(r"[\w.]+(Error|Exception)\b", lines[-1]) else f"{type(err).__name__}: {lines[-1]}"


# Ray Data reads its loggers' level from this variable whenever it (re)configures them, in every process.
RAY_DATA_LEVEL_VAR = "RAY_DATA_LOG_LEVEL"


def quiet_ray_env(verbose: bool) -> dict[str, str]:
    """Environment for every process of the job: Ray Data's INFO lines (per-dataset execution plans, Parquet
    encoding estimates) off the console unless `verbose` (`run.verbose`)."""
    return {} if verbose else {RAY_DATA_LEVEL_VAR: "WARNING"}


def ray_init_logging(verbose: bool) -> dict[str, Any]:
    """`ray.init` keywords: Ray's own INFO lines (connecting, starting a local Ray) only when `verbose`."""
    return {} if verbose else {"logging_level": logging.WARNING}


def quiet_ray_logs() -> None:
    """In this process (the driver, a Ray Train worker): Ray's INFO lines off (Ray Train's own still go to its log
    files under the Ray session's logs/train), its warnings kept.
    Ray Train's own `ray.train` loggers follow the run's LoggingConfig (trainers/worker.py: run_config); this covers
    Ray Data, its notice that progress bars are off (the run turned them off: `run.progress`), and the loggers some
    Ray modules name by their file path, which no level setting of Ray reaches (Ray Train's per-report
    `Reporting training result N: TrainingReport(...)` line)."""
    import ray

    os.environ.update(quiet_ray_env(False))
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    ray_dir = os.path.dirname(ray.__file__)
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(ray_dir):
            logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger("ray.train").handlers:  # a worker's: its console, not its log files
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.addFilter(worker_error_line)


WORKER_ERROR = "Error in training function"  # how Ray Train's worker logs its training function's traceback


def worker_error_line(record: logging.LogRecord) -> bool:
    """A console filter of a Ray Train worker: its training function's traceback becomes one line, the error
    itself (Ray Train may restart the workers; if the run fails, the driver's own line comes last and the run keeps
    the traceback as `error.txt`). Ray's log files keep the whole record; `-v` shows it here too."""
    message = record.getMessage()
    if not message.startswith(WORKER_ERROR):
        return True
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    sys.stderr.write(f"worker error: {lines[-1]} (its traceback: -v, or the run's error.txt if the run fails)\n")
    sys.stderr.flush()
    return False


def quiet_lightning_logs() -> None:
    """In a trainer=lightning worker: Lightning's INFO lines (which accelerators it found, its tips and its Slurm
    hint) off the console unless `run.verbose`; its warnings kept."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


@contextmanager
def native_stderr_filtered(keep: Callable[[list[str]], list[str]]) -> Iterator[None]:
    """The block's writes to file descriptor 2 (native libraries write there directly, past Python's sys.stderr)
    into a temporary file, then the lines `keep` returns to the real stderr. A file, not a pipe: a library writing
    more than a pipe holds while it holds the GIL would wait forever for a reader thread. Meant for short blocks
    (an import): what a thread of the process writes meanwhile is shown after the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = keep(capture.read().decode(errors="replace").splitlines(keepends=True))
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


# TensorFlow's native libraries log while they load, before absl's logging is initialised: absl then writes every
# message to stderr under a banner, and TF_CPP_MIN_LOG_LEVEL is not applied yet (TensorFlow 2.21; each of two
# libraries prints the oneDNN and CUDA lines once, in every TensorFlow process of a run).
ABSL_PRE_INIT_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ABSL_SEVERITY = re.compile(r"([IWEF])\d{4} ")  # absl's line prefix: severity, then month and day
NO_CUDA_DRIVER = "Could not find cuda drivers on your machine"
CUINIT_FAILED = "failed call to cuInit"


def tf_start_up_lines(lines: list[str], min_level: int) -> list[str]:
    """The lines of TensorFlow's start-up a user asked for: not absl's banner, not the absl lines below `min_level`
    (TF_CPP_MIN_LOG_LEVEL: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL), and, where TensorFlow found no CUDA driver, not
    the failed `cuInit` that follows from it. Anything else (Python warnings, other libraries) is kept."""
    no_driver = any(NO_CUDA_DRIVER in line for line in lines)

    def shown(line: str) -> bool:
        severity = ABSL_SEVERITY.match(line)
        if line.startswith(ABSL_PRE_INIT_BANNER) or (severity and "IWEF".index(severity[1]) < min_level):
            return False
        return not (no_driver and CUINIT_FAILED in line)
    return [line for line in lines if shown(line)]


def quiet_keras_predict(keras: ModuleType) -> None:
    """In a thread that runs a tf-keras model's `predict` outside training (logging the model, scoring): no
    progress line per call. tf-keras draws its bar on stdout unless interactive logging is off (a setting of each
    thread), and then logs it as an absl INFO record, which a Ray worker's logging prints: both are off here,
    absl's warnings kept."""
    keras.utils.disable_interactive_logging()
    logging.getLogger("absl").setLevel(logging.WARNING)


def import_tensorflow() -> ModuleType:
    """TensorFlow, imported and its devices listed (where it initialises CUDA) with the start-up lines that
    TF_CPP_MIN_LOG_LEVEL does not reach filtered as it says (`tf_start_up_lines`), and the INFO records of its
    Python loggers off where that level is 1 or more: TensorFlow's (a MultiWorkerMirroredStrategy worker logs its
    cluster and each collective it builds) and absl's (a DTensor client logs its whole server_def, its devices,
    which client it is). A process calls this before its first `import tensorflow`; TensorFlow's threads and logical
    devices can still be set afterwards."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    setting = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")
    level = int(setting) if setting.isdigit() else 0
    with native_stderr_filtered(lambda lines: tf_start_up_lines(lines, level)):
        import tensorflow as tf

        tf.config.list_physical_devices()
    if level >= 1:
        tf.get_logger().setLevel(logging.WARNING)
        logging.getLogger("absl").setLevel(logging.WARNING)
    return tf
