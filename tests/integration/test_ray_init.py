"""A driver's Ray session. `pipelines.fit.init_ray`: the job's processes ask their own cluster's State API,
whatever `ray_current_cluster` says. Ray Train's placement-group cleaner asks it whether the run's controller lives;
asking another cluster, it finds no such controller and removes the run's placement group, or exits at once (seen
beside a `ray start` head on this machine: "Found multiple active Ray instances ... Connecting to latest cluster").
`pipelines.ray_session.shutdown_ray`: garbage freed in another thread meanwhile does not end the driver."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, pipeline_env

pytestmark = pytest.mark.slow

# The driver's side (what `pipelines.train` and `pipelines.sweep` run), then a task inside the cluster resolving
# the State API address as the cleaner does (no address given).
DRIVER = """
import json, ray
from ray.dashboard.utils import get_address_for_submission_client, ray_address_to_api_server_url
from pipelines.fit import init_ray

init_ray(2)

@ray.remote
def state_api_seen_by_a_task():
    return get_address_for_submission_client(None)

own = ray_address_to_api_server_url(ray.get_runtime_context().gcs_address)
print(json.dumps({"own": own, "seen": ray.get(state_api_seen_by_a_task.remote())}))
"""


def state_api_addresses(env: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_jobs_processes_ask_their_own_clusters_state_api(ray_head):
    # A local Ray beside the session's head, with a `ray_current_cluster` naming that head (as `ray start` leaves
    # it): RAY_TMPDIR moves Ray's temp folder, which the local Ray's processes inherit. Short: Ray's socket paths.
    temp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text(ray_head["RAY_ADDRESS"])
        local = state_api_addresses({**pipeline_env("unused"), "RAY_TMPDIR": str(temp)})
        assert local["seen"] == local["own"] != ray_head["RAY_DASHBOARD_ADDRESS"]
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    # A job on the session's head (RAY_ADDRESS), as `ray job submit` runs the pipelines.
    submitted = state_api_addresses(pipeline_env("unused", ray_head))
    assert submitted["seen"] == submitted["own"] == ray_head["RAY_DASHBOARD_ADDRESS"]


# Another thread frees ObjectRefs held in reference cycles (garbage only the cyclic collector frees, as Ray Data's
# usage poller does in every driver that read a dataset) all through the shutdown; paced, so that it goes on until
# the shutdown is over. `ray.shutdown()` alone ends this process with exit 1 ("The core worker has already been
# shutdown"): 3 of 3 tries.
SHUTDOWN_DRIVER = """
import gc, threading, time, ray
from pipelines.ray_session import shutdown_ray

ray.init(log_to_driver=False)
gc.set_threshold(1)  # a collection at (almost) every allocation: each freed cycle is freed at once
refs, shut_down, churning = [ray.put(i) for i in range(3000)], threading.Event(), threading.Event()

def free_refs_in_cycles():
    while refs and not shut_down.is_set():
        node = {"ref": refs.pop()}
        node["self"] = node
        del node
        churning.set()
        time.sleep(0.001)

threading.Thread(target=free_refs_in_cycles, daemon=True).start()
churning.wait()
shutdown_ray()
shut_down.set()
print("refs left when Ray was down:", len(refs))
"""


def test_garbage_freed_by_another_thread_during_the_shutdown_does_not_end_the_driver(ray_head):
    proc = subprocess.run([sys.executable, "-c", SHUTDOWN_DRIVER], cwd=ROOT, env=pipeline_env("unused", ray_head),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    left = int(proc.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert left > 0, "the thread ran out of refs before the shutdown: the test checked nothing"
