"""A driver's Ray session: connecting to the cluster at RAY_ADDRESS, or starting a local Ray of its own that only
this user can use, and ending the session without ending the driver."""
from __future__ import annotations

import gc
import os
import secrets
import socket
import sys
from typing import Any, Mapping

# Ray takes a node for a one-machine cluster, with node IP 127.0.0.1 and every port (GCS, raylet, object manager,
# agents, workers, metrics) bound to 127.0.0.1, when this is 0, as it does by default on macOS and Windows.
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect_or_start_ray(start_kwargs: dict[str, Any], **connect_kwargs: Any) -> None:
    """`ray.init` on the cluster at RAY_ADDRESS (with `connect_kwargs`), else a local Ray of this driver's own
    (`start_local_ray(**start_kwargs)`): never another cluster on this machine found by accident."""
    if address := os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=address, **connect_kwargs)
    else:
        start_local_ray(**start_kwargs)


def ray_address_problem(timeout_s: float = 5.0) -> str | None:
    """Why the cluster at RAY_ADDRESS cannot be reached, or None: its GCS (`host:port`, or a Ray Client's
    `ray://host:port`) must take a TCP connection; `ray.init` would otherwise retry for minutes. "auto" and other
    forms are left to Ray."""
    address = os.environ.get("RAY_ADDRESS", "")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or "/" in host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        return (f"RAY_ADDRESS={address}: no Ray cluster answers there ({err.strerror or err}); start it, or unset "
                f"RAY_ADDRESS to run on a Ray of this machine's own")
    return None


def start_local_ray(**init_kwargs: Any) -> None:
    """Start a local Ray (`ray.init(address="local", **init_kwargs)`) that other machines cannot reach and other
    users of this one cannot use: every port on loopback only, and token authentication with a new random token
    that lives only in the environment of this driver and of the Ray processes it starts (readable by this user
    alone, as /proc/<pid>/environ is). A login node is shared; a Ray without a token runs anyone's code as ours."""
    use_ray_settings({LOOPBACK_VAR: "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    import ray

    ray.init(address="local", **init_kwargs)


def use_ray_settings(settings: Mapping[str, str]) -> None:
    """Put Ray's settings (RAY_* variables: loopback, auth mode, token) into this process's environment, where the
    Ray processes it starts inherit them. Ray reads them once, when imported; a `ray` imported earlier (in a test, a
    notebook) is told again, as Ray's own token set-up does."""
    os.environ.update(settings)
    if "ray" not in sys.modules:
        return
    from ray._common.utils import env_bool
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config

    ray_constants.ENABLE_RAY_CLUSTER = env_bool(LOOPBACK_VAR, True)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def shutdown_ray() -> None:
    """`ray.shutdown()` with Python's cyclic garbage collector paused. An `ObjectRef` freed while Ray shuts down
    ends the whole process at once, with exit 1 and "The core worker has already been shutdown", before the driver
    can print how its run ended. The collector frees the refs that sit in reference cycles, in whichever thread
    happens to allocate: Ray Data's usage poller, say, which wakes every 10 s in every driver that read a dataset.
    So the garbage is collected first, while Ray is up, and none again until Ray is down (a ref freed then does
    nothing). A run failed by `fault.resource_timeout_s`, say, would otherwise lose its last line."""
    import ray

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ray.shutdown()
    finally:
        if was_enabled:
            gc.enable()
