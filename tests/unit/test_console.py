"""What the console says of a failure: one line, whatever the error carries (contract/console.py)."""
from __future__ import annotations

import logging

from ray.train.v2.api.exceptions import WorkerGroupError

from contract.console import RAY_DATA_LEVEL_VAR, one_line, quiet_ray_logs


def test_a_worker_groups_failure_is_its_ranks_and_their_error_in_one_line():
    snippet = "[Rank 1 Error Snippet]:\nTraceback (most recent call last):\n  File ...\nRuntimeError: boom"
    failed = WorkerGroupError(snippet, {3: RuntimeError("boom at epoch 2"), 1: RuntimeError("boom at epoch 1")})
    assert one_line(failed) == "WorkerGroupError (rank 1, 3): RuntimeError: boom at epoch 1"
    assert one_line(ValueError("Traceback (most recent call last):\n  File x\nKeyError: 'image'")) == \
        "KeyError: 'image'"
    assert one_line(ValueError("a\nsecond line")) == "ValueError: second line"
    assert one_line(OSError("disk full")) == "OSError: disk full"


def test_quiet_ray_logs_drops_the_workers_traceback_line_and_keeps_other_errors(caplog, monkeypatch):
    monkeypatch.setenv(RAY_DATA_LEVEL_VAR, "INFO")  # restored after the test, as quiet_ray_logs changes it
    quiet_ray_logs()
    logger = logging.getLogger("ray.train.v2._internal.util")
    with caplog.at_level(logging.ERROR, logger="ray.train.v2._internal.util"):
        logger.error("Error in training function:\nTraceback ...")
        logger.error("something else went wrong")
    assert [record.getMessage() for record in caplog.records] == ["something else went wrong"]
