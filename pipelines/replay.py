"""Finish a run or a sweep whose tracking server was away: `rtp replay <spool folder>` (or `python -m
pipelines.replay <spool folder>`).

A training run keeps what MLflow did not receive in `<run.storage_path>/run-<run id>/mlflow_spool/`
(contract/tracking/spool.py): the workers' unsent metrics and tags, and, when the server was still away at the end,
`final.json` naming the final checkpoint. This sends the records (skipping any the server already has), logs the
final model from the checkpoint and ends the run FINISHED. A sweep whose server was away when its trials ended
keeps `sweep.json` (how each trial ended) in its parent run's spool folder: the replay finishes every trial's run
that way, then closes the child runs, builds the report and ends the parent run as the sweep would have.
MLFLOW_TRACKING_URI, when set, names the server (it may have moved); else the one the run used.
Exit codes: 0 done, 1 the server took some records but not all (run it again), 2 bad folder or server unreachable.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from contract import tracking
from pipelines.fit import replay_run
from pipelines.help import wants_help
from pipelines.sweep.runs import finish_recorded_sweep


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(f"usage: rtp replay <spool folder>\n\n{__doc__.split(chr(10), 2)[2].strip()}")
        return 0
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"error: usage: rtp replay <spool folder> (got {' '.join(argv) or 'nothing'})",
              file=sys.stderr)
        return 2
    folder, uri = Path(argv[0]), os.environ.get("MLFLOW_TRACKING_URI")
    try:
        if (folder / tracking.SWEEP_FILE).is_file():
            parent_id, outcome = finish_recorded_sweep(folder, uri)
            print(f"replayed {folder} into the sweep's MLflow runs: {outcome}")
            print(f"mlflow_parent_run_id={parent_id}", flush=True)
            return 0
        run_id = replay_run(folder, uri)
    except (ValueError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"replayed {folder} into the MLflow run")
    print(f"mlflow_run_id={run_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
