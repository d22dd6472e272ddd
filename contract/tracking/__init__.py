"""The MLflow contract every backend shares.

The driver creates the run (so it exists before any worker starts and can always be closed as FAILED),
logs params and the resolved config; rank 0 of the trainer logs per-epoch metrics into that run; the
driver logs the final model and the end status. Workers write through a `TrackingSpool`, so a tracking
server that goes away loses nothing: what it missed waits in the run's storage (`spool_dir`) until the
driver, or `rtp replay`, sends it.

One module per concern: where runs are tracked (server, check, store), a run's life (runs), where it came from
(provenance), the data it read (lineage), the durable spool (spool), rank 0's logger (logger), system metrics
(system), the trained model (models). This package's names are the public API.
"""
from contract.tracking.check import answers, check_reachable
from contract.tracking.lineage import DatasetRef, log_data_files, log_dataset_inputs
from contract.tracking.logger import EpochLogger, epoch_values, lineage_start_ms, now_ms
from contract.tracking.models import log_torch_model, logged_models, register_logged_model
from contract.tracking.runs import (check_experiment, check_recorded_run, close_orphaned_runs, driver_tags, end_run,
                                    end_unfinished_run, ended_on_error, log_attempt_changes, log_cluster_startup,
                                    log_hangs, log_metrics, log_params, mark_interrupted, mark_preempted, reopen_run,
                                    run_exists, set_tags, start_run)
from contract.tracking.server import TrackingUnavailable, mlflow_client, tracking_uri
from contract.tracking.spool import (FINAL_FILE, SPOOL_DIR, SWEEP_FILE, TrackingDown, TrackingSpool, flush_spools,
                                     ray_run_name, run_dir, send_or_spool, spool_dir, spool_files, spooled)
from contract.tracking.system import SystemMetrics

__all__ = ["DatasetRef", "EpochLogger", "FINAL_FILE", "SPOOL_DIR", "SWEEP_FILE", "SystemMetrics", "TrackingDown",
           "TrackingSpool", "TrackingUnavailable", "answers", "check_experiment", "check_reachable",
           "check_recorded_run", "close_orphaned_runs", "driver_tags", "end_run", "end_unfinished_run",
           "ended_on_error", "epoch_values", "flush_spools", "lineage_start_ms", "log_attempt_changes",
           "log_cluster_startup", "log_data_files", "log_dataset_inputs", "log_hangs", "log_metrics", "log_params",
           "log_torch_model", "logged_models", "mark_interrupted", "mark_preempted", "mlflow_client", "now_ms",
           "ray_run_name", "register_logged_model", "reopen_run", "run_dir", "run_exists", "send_or_spool", "set_tags",
           "spool_dir", "spool_files", "spooled", "start_run", "tracking_uri"]
