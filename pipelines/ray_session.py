"""Ending a driver's Ray session without ending the driver."""
from __future__ import annotations

import gc


def shutdown_ray() -> None:
    """`ray.shutdown()` with Python's cyclic garbage collector paused. An `ObjectRef` freed while Ray shuts down
    ends the whole process at once, with exit 1 and "The core worker has already been shutdown", before the driver
    can print how its run ended. The collector frees the refs that sit in reference cycles, in whichever thread
    happens to allocate: Ray Data's usage poller, say, which wakes every 10 s in every driver that read a dataset.
    So the garbage is collected first, while Ray is up, and none again until Ray is down (a ref freed then does
    nothing). Seen once in CI: a run's last line lost after `fault.resource_timeout_s` failed it."""
    import ray

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ray.shutdown()
    finally:
        if was_enabled:
            gc.enable()
