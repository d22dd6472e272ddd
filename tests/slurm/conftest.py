"""A real 2-node Slurm on this machine (cluster/dev/slurm-local.sh) and helpers to run sbatch jobs on it."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]

SLURM_SCRIPT = REPO / "cluster" / "slurm" / "ray-cluster.sbatch"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> dict[str, str]:
    """Environment for sbatch/scontrol against the local 2-node cluster (nodes n1, n2)."""
    state = Path(os.environ.get("SLURM_LOCAL_STATE", "/tmp/rtp-slurm"))
    subprocess.run(["bash", str(REPO / "cluster" / "dev" / "slurm-local.sh"), "up", str(state)], check=True)
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    yield env
    subprocess.run(["bash", str(REPO / "cluster" / "dev" / "slurm-local.sh"), "down", str(state)], check=True)


def sbatch(env: dict[str, str], out_dir: Path, command: list[str], sbatch_args: list[str] = (),
           extra_env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
    """Submit cluster/slurm/ray-cluster.sbatch from the repository root (or from a user's folder `cwd`, naming
    the repository in RAY_SLURM_REPO); returns the job id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job_env = {key: value for key, value in env.items() if key != "MLFLOW_TRACKING_URI"}
    job_env.update({"RAY_SLURM_DIR": str(out_dir), "RAY_SLURM_REPO": str(REPO), **(extra_env or {})})
    proc = subprocess.run(["sbatch", "--parsable", "-o", str(out_dir / "out-%j.txt"), *sbatch_args,
                           str(SLURM_SCRIPT), *command], cwd=cwd, env=job_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_info(env: dict[str, str], job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(env: dict[str, str], job_id: str, timeout_s: float, restarts: int = 0) -> dict[str, str]:
    """Bounded wait until the job reached a final state (after `restarts` requeues)."""
    def done() -> bool:
        info = job_info(env, job_id)
        return info.get("JobState") in TERMINAL and int(info.get("Restarts", 0)) >= restarts
    wait_until(done, timeout_s, f"slurm job {job_id}")
    return job_info(env, job_id)


def skip_requeue_delay(env: dict[str, str], job_id: str, timeout_s: float) -> None:
    """Slurm makes a requeued job eligible again only after a delay (its BeginTime, about two minutes later);
    a site's scheduler would start it then. The test moves that begin time to 5 s after the requeue: not to now,
    because slurmd refuses a launch whose credential dates from the same second as the old instance's revocation
    ("Job credential revoked", seen once when the new allocation came 0.2 s after the requeue)."""
    def requeued() -> bool:  # pending again, or already past it
        info = job_info(env, job_id)
        return int(info.get("Restarts", 0)) >= 1 and info.get("JobState") in ("PENDING", "RUNNING", *TERMINAL)
    wait_until(requeued, timeout_s, f"slurm job {job_id} to be requeued")
    if job_info(env, job_id).get("JobState") == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+5"], env=env, check=True)


def job_output(out_dir: Path, job_id: str) -> str:
    path = out_dir / f"out-{job_id}.txt"
    return path.read_text() if path.exists() else ""


def ray_leftovers(job_id: str) -> list[str]:
    """Processes and temp dirs of the job's Ray nodes still on this machine (all nodes share it here)."""
    procs = subprocess.run(["pgrep", "-af", f"ray-slurm-{job_id}-"], capture_output=True, text=True).stdout
    dirs = [str(p) for p in Path("/tmp").glob(f"ray-slurm-{job_id}-*")]
    return [line for line in procs.splitlines() if "pgrep" not in line] + dirs


def wait_gone(job_id: str, timeout_s: float = 60) -> None:
    wait_until(lambda: not ray_leftovers(job_id), timeout_s, f"Ray processes of job {job_id} to end")


def elapsed_s(info: dict[str, str]) -> float:
    start = time.strptime(info["StartTime"], "%Y-%m-%dT%H:%M:%S")
    end = time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S")
    return time.mktime(end) - time.mktime(start)
