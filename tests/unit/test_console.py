"""What the console says of a failure: one line, whatever the error carries; what TensorFlow's start-up prints
(contract/console.py)."""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import pytest

from ray.train.v2.api.exceptions import WorkerGroupError

from contract.console import native_stderr_filtered, one_line, tf_start_up_lines, worker_error_line


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


# What `import tensorflow` and its first device listing print on a machine without CUDA (TensorFlow 2.21), and
# lines of other kinds around them.
BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = "I0000 00:00:1796336362.999290    3978 port.cc:153] oneDNN custom operations are on.\n"
NO_DRIVER = "I0000 00:00:1796336362.999593    3978 cudart_stub.cc:31] Could not find cuda drivers on your machine\n"
CUINIT = ("E0000 00:00:1796336370.607217    3987 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)\n")
WARNING = "W1203 22:31:02.000001    3978 some_op.cc:12] a warning\n"
ERROR = "E1203 22:31:02.000002    3978 some_op.cc:13] an error\n"
PYTHON = "/x/site-packages/y.py:3: DeprecationWarning: old\n"


def test_tensorflows_start_up_lines_are_shown_as_its_log_level_says():
    lines = [BANNER, ONEDNN, NO_DRIVER, BANNER, ONEDNN, NO_DRIVER, WARNING, ERROR, PYTHON, CUINIT]
    assert tf_start_up_lines(lines, 2) == [ERROR, PYTHON]
    assert tf_start_up_lines(lines, 1) == [WARNING, ERROR, PYTHON]
    assert tf_start_up_lines(lines, 0) == [ONEDNN, NO_DRIVER, ONEDNN, NO_DRIVER, WARNING, ERROR, PYTHON]
    # Where TensorFlow found a CUDA driver, a failed cuInit is a real error: shown.
    assert tf_start_up_lines([BANNER, ONEDNN, CUINIT], 2) == [CUINIT]


@pytest.mark.parametrize("fails", [False, True])
def test_native_writes_to_stderr_are_filtered_and_stderr_restored(capfd, fails):
    def keep(lines: list[str]) -> list[str]:
        return [line for line in lines if "chatter" not in line]
    with pytest.raises(RuntimeError) if fails else nullcontext():
        with native_stderr_filtered(keep):
            os.write(2, b"chatter from a library\nkept 1\n")  # straight to the descriptor, as native code writes
            if fails:
                raise RuntimeError("the block failed")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "kept 1\nafter\n"  # the block's lines kept, and fd 2 itself again after
