"""What the console says of a failure: one line, whatever the error carries (contract/console.py)."""
from __future__ import annotations

import logging

from ray.train.v2.api.exceptions import WorkerGroupError

from contract.console import one_line, worker_error_line


def test_a_worker_groups_failure_is_its_ranks_and_their_error_in_one_line():
    snippet = "[Rank 1 Error Snippet]:\nTraceback (most recent call last):\n  File ...\nRuntimeError: boom"
    failed = WorkerGroupError(snippet, {3: RuntimeError("boom at epoch 2"), 1: RuntimeError("boom at epoch 1")})
    assert one_line(failed) == "WorkerGroupError (rank 1, 3): RuntimeError: boom at epoch 1"
    assert one_line(ValueError("Traceback (most recent call last):\n  File x\nKeyError: 'image'")) == \
        "KeyError: 'image'"
    assert one_line(ValueError("a\nsecond line")) == "ValueError: second line"
    assert one_line(OSError("disk full")) == "OSError: disk full"


def test_a_workers_traceback_is_one_line_on_its_console(capsys):
    traceback = "Error in training function:\nTraceback (most recent call last):\n  File x\nRuntimeError: ps:0 exited\n"
    record = logging.LogRecord("ray.train.v2._internal.util", logging.ERROR, "util.py", 252, traceback, None, None)
    assert worker_error_line(record) is False  # the traceback itself is not printed
    assert capsys.readouterr().err == ("worker error: RuntimeError: ps:0 exited (its traceback: -v, or the run's "
                                       "error.txt if the run fails)\n")
    other = logging.LogRecord("ray.train", logging.ERROR, "x.py", 1, "something else went wrong", None, None)
    assert worker_error_line(other) is True and capsys.readouterr().err == ""
