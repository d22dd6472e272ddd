"""The failed start of a worker group whose nodes the preflight left out (trainers/preflight.py). Ray Train's own
failed-start error: its controller retries it where it may retry starts (an elastic run); where it may not (a run
of a fixed size gives up on its first failed start), the driver fits again (pipelines/fit.py). A module of its own:
it imports Ray Train, which trainers/preflight.py leaves to the functions that run inside Ray."""
from __future__ import annotations

from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError


class NodesLeftOut(WorkerGroupStartupFailedError):
    """The preflight stopped the nodes at fault; the next start goes without them."""
