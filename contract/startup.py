"""Where a run's start-up goes: from the moment the run was asked for to the end of its first training step, in
parts. Rank 0 logs them once, at its first step, as the run's `startup.*` metrics (step 1):

- `startup.driver_s`: the driver, until the trainer is built: Python imports, config and data checks, Ray
  connection (a local Ray is started here), the MLflow run;
- `startup.workers_s`: Ray Train's controller, its worker group, and each worker's imports;
- `startup.data_s`: rank 0 waiting for Ray Train to split the datasets, then pulling its shard from Ray Data
  (the epoch metric `data_load_s` too);
- `startup.model_s`: the model, optimizer, process group or strategy, and a checkpoint's restore;
- `startup.first_step_s`: the first training step (kernel and graph warm-up, the first collectives);
- `startup.total_s`: all of it.

The driver also logs `startup.driver_before_run_s` when it creates the MLflow run: the part of `startup.driver_s`
before the run existed, so that a run's goodput (pipelines/goodput.py) counts the rest of the driver's part.

"Asked for" is PIPELINE_STARTED_AT (Unix seconds) when the submitter sets it, e.g.
`ray job submit --runtime-env-json "{\"env_vars\": {\"PIPELINE_STARTED_AT\": \"$(date +%s.%N)\"}}" -- ...`, so a
job's queueing and upload count too; else the start of the driver's process. The parts are wall-clock differences
between the driver's and rank 0's node: across nodes they carry the clocks' offset (NTP keeps it to
milliseconds)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

IMPORTED_AT = time.time()
STARTED_AT_ENV = "PIPELINE_STARTED_AT"
STARTUP_PARTS = ("startup.driver_s", "startup.workers_s", "startup.data_s", "startup.model_s", "startup.first_step_s")
STARTUP_TOTAL = "startup.total_s"
DRIVER_BEFORE_RUN = "startup.driver_before_run_s"  # the driver's, at the run's creation


def started_at() -> float:
    """When the run was asked for: PIPELINE_STARTED_AT if set, else when this (the driver's) process started."""
    value = os.environ.get(STARTED_AT_ENV)
    return float(value) if value else process_started()


def process_started() -> float:
    """This process's start in Unix seconds, from Linux's /proc to 10 ms (its start in clock ticks after boot, and
    the time since boot); where there is no /proc, when this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, "starttime"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + after_boot
    except (OSError, ValueError, IndexError):
        return IMPORTED_AT


@dataclass(frozen=True)
class StartupMarks:
    """Wall-clock times (Unix seconds) of the start-up's milestones before the training loop begins."""
    asked: float        # the run was asked for
    trainer_built: float  # the driver built the trainer (the loop config was made)
    worker_began: float   # rank 0's training function began

    def metrics(self, loop_began: float, data_s: float, first_step_done: float) -> dict[str, float]:
        """The `startup.*` metrics, given when the loop began (model built, data pulled) and the first step ended."""
        parts = (self.trainer_built - self.asked, self.worker_began - self.trainer_built, data_s,
                 loop_began - self.worker_began - data_s, first_step_done - loop_began)
        return {**dict(zip(STARTUP_PARTS, parts)), STARTUP_TOTAL: first_step_done - self.asked}
