"""MLflow's system metrics (CPU, memory, disk, network, GPUs) of one process of a run."""
from __future__ import annotations

import logging

from contract.console import say
from contract.tracking.check import answers


class SystemMetrics:
    """MLflow's system metrics monitor (CPU, memory, disk, network; GPUs when NVML is there) for one process of a
    run: a thread that logs `system/<node>/<metric>` every `interval_s` and ends by itself when the run does. It
    starts after the run's last system metrics step, so a restarted worker logs no step twice. Best effort: a
    tracking server that does not answer ends the thread with a warning and never the training."""

    def __init__(self, uri: str, run_id: str, node: str, interval_s: float):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start and stop lines are noise
        self.uri, self.monitor = uri, None
        try:  # asks the server for the last step: a worker restarted while the server is away goes on without
            self.monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, node_id=node,
                                                tracking_uri=uri, resume_logging=True)
            self.monitor.start()
        except Exception as err:
            say(f"tracking: no system metrics for {node} ({type(err).__name__}: {err})")

    def stop(self) -> None:
        """Log what is sampled and stop; with the server away, leave the (daemon) thread instead: MLflow's client
        would retry for minutes."""
        if self.monitor is not None and answers(self.uri):
            self.monitor.finish()
