"""Finish a run whose tracking server was away: `python -m pipelines.replay <spool folder>`.

A training run keeps what MLflow did not receive in `<run.storage_path>/run-<run id>/mlflow_spool/`
(contract/tracking.py): the workers' unsent metrics and tags, and, when the server was still away at the end,
`final.json` naming the final checkpoint. This sends the records (skipping any the server already has), logs the
final model from the checkpoint and ends the run FINISHED. MLFLOW_TRACKING_URI, when set, names the server
(it may have moved); else the one the run used.
Exit codes: 0 done, 1 the server took some records but not all (run it again), 2 bad folder or server unreachable.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from contract import tracking
from contract.config import typed_config
from trainers import get_backend


def replay(folder: Path) -> str:
    """Send the spooled records and finish the run; returns its id. Raises TrackingUnavailable, ValueError."""
    from ray.train import Checkpoint

    files = [*sorted(folder.glob("rank*.json")), folder / tracking.FINAL_FILE]
    recorded = next((json.loads(path.read_text()) for path in files if path.is_file()), None)
    if recorded is None:
        raise ValueError(f"{folder}: no spooled records (nothing to replay)")
    run_id = recorded["run_id"]
    uri = os.environ.get("MLFLOW_TRACKING_URI") or recorded["uri"]
    tracking.check_reachable(uri)
    unsent = tracking.flush_spools(uri, run_id, folder)
    if unsent:
        raise RuntimeError(f"{unsent} record(s) were not accepted by {uri}; run the replay again")
    final = folder / tracking.FINAL_FILE
    if final.is_file():
        spec = json.loads(final.read_text())
        cfg = typed_config(spec["cfg"])
        tracking.set_tags(uri, run_id, spec.get("tags", {}))
        get_backend(cfg.trainer.backend).log_final_model(uri, run_id, cfg, Checkpoint(spec["checkpoint"]),
                                                         spec["model_inputs"])
        if cfg.run.register_model:
            tracking.register_logged_model(uri, run_id, cfg.run.register_model)
        tracking.end_run(uri, run_id)
        final.unlink()
    return run_id


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"error: usage: python -m pipelines.replay <spool folder> (got {' '.join(argv) or 'nothing'})",
              file=sys.stderr)
        return 2
    try:
        run_id = replay(Path(argv[0]))
    except (ValueError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"replayed {argv[0]} into the MLflow run")
    print(f"mlflow_run_id={run_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
