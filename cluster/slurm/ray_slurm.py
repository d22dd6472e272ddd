"""Helpers of ray-cluster.sbatch that need Ray's Python APIs (run with the project's .venv python):

    ray_slurm.py wait-nodes --dashboard URL --expect n1=10.0.0.1 n2=10.0.0.2 --timeout 180
        Wait until a Ray node is alive at every expected address; on timeout name the missing nodes, exit 1.
    ray_slurm.py submit --dashboard URL --cwd DIR [--env K=V ...] [--pass-env NAME ...] -- COMMAND...
        `ray job submit` that streams the job's output and exits with the job's own exit code (the CLI
        only says failed or not; the Slurm script must tell "preempted, requeue me" (3) from a failure).
        --pass-env hands this process's NAME on to the job when set (secrets: never on a command line).
    ray_slurm.py free-block --first 20000 --key JOB_ID [--size 400]
        Print the base port of a port block whose ports are all free on this host: block `key % blocks` first,
        then the following ones (wrapping around); exit 1 naming the range when none is free.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import sys
import time


def alive_node_addresses(dashboard: str) -> set[str]:
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    return {node.node_ip for node in nodes}


def wait_nodes(dashboard: str, expected: dict[str, str], timeout_s: float) -> int:
    """Poll the head's State API (bounded) until every expected address has an alive Ray node."""
    deadline = time.monotonic() + timeout_s
    joined: set[str] = set()
    last_error = ""
    while time.monotonic() < deadline:
        try:
            joined = alive_node_addresses(dashboard)
            last_error = ""
        except Exception as err:  # the dashboard answers a few seconds after the head started
            last_error = f"{type(err).__name__}: {err}"
        if set(expected.values()) <= joined:
            return 0
        time.sleep(1.0)
    missing = [f"{name} ({addr})" for name, addr in expected.items() if addr not in joined]
    print(f"ray-cluster: error: {len(missing)} of {len(expected)} nodes did not join the Ray cluster within "
          f"{timeout_s:g} s: {', '.join(missing)}" + (f" (last error: {last_error})" if last_error else ""),
          file=sys.stderr)
    return 1


def submit(dashboard: str, cwd: str, env: dict[str, str], command: list[str]) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard)
    # A shared filesystem: the job runs in `cwd` itself (no upload), and its workers import from it and from the
    # checkout (RAY_SLURM_REPO, set by the batch script).
    entrypoint = f"cd {shlex.quote(cwd)} && {shlex.join(command)}"
    paths = list(dict.fromkeys([cwd, os.environ.get("RAY_SLURM_REPO", cwd)]))
    job_id = client.submit_job(entrypoint=entrypoint,
                               runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths), **env}})
    print(f"ray-cluster: submitted job {job_id}: {shlex.join(command)}", flush=True)

    async def stream() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(stream())
    while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                            JobStatus.STOPPED}:
        time.sleep(0.5)  # the log stream ends when the driver exits; the status follows shortly after
    info = client.get_job_info(job_id)
    code = info.driver_exit_code
    if code is None:
        code = 0 if status == JobStatus.SUCCEEDED else 1
    print(f"ray-cluster: job {job_id} {status.value}, exit code {code}", flush=True)
    return code


def block_is_free(base: int, size: int) -> bool:
    """Every port of [base, base+size) can be bound on this host (a listener on any address blocks it)."""
    for port in range(base, base + size):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


def ephemeral_low(default: int = 32768) -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take ports from there at any time,
    so a Ray cluster's ports must stay below it)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def block_count(first: int, size: int) -> int:
    """Blocks of `size` ports between `first` and the ephemeral range (at least 1, at most 100)."""
    return max(1, min(100, (ephemeral_low() - first) // size))


def free_block(first: int, key: int, size: int, blocks: int | None = None) -> int | None:
    """The base port of the first free block, trying block `key % blocks` first (the job id's own block, so jobs
    rarely need to move) and then the following ones; None when all are taken."""
    blocks = blocks or block_count(first, size)
    for offset in range(blocks):
        base = first + ((key + offset) % blocks) * size
        if block_is_free(base, size):
            return base
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray_slurm.py")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait-nodes")
    wait.add_argument("--dashboard", required=True)
    wait.add_argument("--expect", nargs="+", required=True, metavar="NAME=ADDR")
    wait.add_argument("--timeout", type=float, default=180.0)
    run = sub.add_parser("submit")
    run.add_argument("--dashboard", required=True)
    run.add_argument("--cwd", required=True)
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--pass-env", action="append", default=[], metavar="NAME")
    run.add_argument("job", nargs=argparse.REMAINDER)
    ports = sub.add_parser("free-block")
    ports.add_argument("--first", type=int, required=True)
    ports.add_argument("--key", type=int, required=True)
    ports.add_argument("--size", type=int, default=400)
    args = parser.parse_args(argv)
    if args.command == "free-block":
        base = free_block(args.first, args.key, args.size)
        if base is None:
            end = args.first + block_count(args.first, args.size) * args.size - 1
            print(f"ray-cluster: error: no free block of {args.size} ports in {args.first}..{end} on "
                  f"{socket.gethostname()}", file=sys.stderr)
            return 1
        print(base)
        return 0
    if args.command == "wait-nodes":
        return wait_nodes(args.dashboard, dict(item.split("=", 1) for item in args.expect), args.timeout)
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    env = dict(item.split("=", 1) for item in args.env)
    env.update({name: os.environ[name] for name in args.pass_env if os.environ.get(name)})
    return submit(args.dashboard, args.cwd, env, job)


if __name__ == "__main__":
    sys.exit(main())
