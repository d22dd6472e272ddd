"""Helpers of ray-cluster.sbatch that need Ray's Python APIs (run with the project's .venv python):

    ray_slurm.py wait-nodes --dashboard URL --expect n1=10.0.0.1 n2=10.0.0.2 --timeout 180 [--head-timeout 300]
                            [--head-pid PID] [--job-start EPOCH_S]
        Wait until a Ray node is alive at every expected address, the first one being the head's. First the head
        (its node alive in the State API, which its dashboard serves): up to --head-timeout s, or until the process
        --head-pid (its srun) exits; exit 2 naming it. Then the other nodes: --timeout s counted from the moment
        the head is up (a head slow to start under load is not reported as nodes failing to join); exit 1 naming
        the missing ones.
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
import math
import os
import shlex
import socket
import sys
import time


def alive_node_addresses(dashboard: str, timeout_s: int = 30) -> set[str]:
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], timeout=timeout_s,
                       raise_on_missing_output=False)
    return {node.node_ip for node in nodes}


def one_line(err: Exception, limit: int = 300) -> str:
    """An exception as one short line (Ray's errors can span many lines)."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def process_exited(pid: int | None) -> bool:
    """The process `pid` (a child of the batch shell: the head's srun) has ended; a zombie counts as ended."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return not os.path.exists(f"/proc/{pid}")


POLL_S = 1.0


def wait_nodes(dashboard: str, expected: dict[str, str], timeout_s: float, head_timeout_s: float = 300.0,
               head_pid: int | None = None, job_start: float | None = None) -> int:
    """Poll the head's State API (bounded) until every expected address has an alive Ray node: the head (the first
    of `expected`) within `head_timeout_s`, then the others within `timeout_s` of the head being up. 0: all joined;
    1: other nodes did not join (named); 2: the head was not up in time or exited (named)."""
    import ray.util.state  # noqa: F401  before any clock starts: importing Ray takes seconds, more on a busy node

    job_start = time.time() if job_start is None else job_start
    (head_name, head_addr), *others = expected.items()
    head = f"the Ray head on {head_name} ({head_addr})"

    def poll(deadline: float) -> tuple[set[str] | None, str]:
        try:  # each State API call bounded by what is left of the wait (at least 1 s)
            return alive_node_addresses(dashboard, max(1, math.ceil(deadline - time.monotonic()))), ""
        except Exception as err:  # the dashboard answers a few seconds after the head's GCS listens
            return None, one_line(err)

    deadline = time.monotonic() + head_timeout_s
    while True:
        nodes, last_error = poll(deadline)
        joined = nodes or set()
        if head_addr in joined:
            break
        if process_exited(head_pid):
            print(f"ray-cluster: error: {head} exited before it was up", file=sys.stderr)
            return 2
        if time.monotonic() >= deadline:
            state = f"last error: {last_error}" if last_error else "its node not alive yet"
            print(f"ray-cluster: error: {head} was not up within {head_timeout_s:g} s ({state}); give it longer "
                  f"with RAY_SLURM_HEAD_TIMEOUT", file=sys.stderr)
            return 2
        time.sleep(POLL_S)
    print(f"ray-cluster: Ray head up after {time.time() - job_start:.1f} s"
          + (f"; waiting up to {timeout_s:g} s for the other {len(others)} node(s)" if others else ""), flush=True)

    deadline = time.monotonic() + timeout_s  # from the head being up: a slow head's start is not theirs
    while not set(expected.values()) <= joined:
        if process_exited(head_pid):
            print(f"ray-cluster: error: {head} exited while the other nodes were joining", file=sys.stderr)
            return 2
        if time.monotonic() >= deadline:
            missing = [f"{name} ({addr})" for name, addr in expected.items() if addr not in joined]
            print(f"ray-cluster: error: {len(missing)} of {len(expected)} nodes did not join the Ray cluster within "
                  f"{timeout_s:g} s: {', '.join(missing)}" + (f" (last error: {last_error})" if last_error else ""),
                  file=sys.stderr)
            return 1
        time.sleep(POLL_S)
        nodes, last_error = poll(deadline)
        if nodes is not None:
            joined = nodes
    return 0


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
    wait.add_argument("--timeout", type=float, default=180.0, help="s for the other nodes, once the head is up")
    wait.add_argument("--head-timeout", type=float, default=300.0, help="s for the head to be up")
    wait.add_argument("--head-pid", type=int, help="the head's process (its srun): its end fails the wait at once")
    wait.add_argument("--job-start", type=float, help="the job's start (epoch s), for the head's start-up time")
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
        return wait_nodes(args.dashboard, dict(item.split("=", 1) for item in args.expect), args.timeout,
                          args.head_timeout, args.head_pid, args.job_start)
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    env = dict(item.split("=", 1) for item in args.env)
    env.update({name: os.environ[name] for name in args.pass_env if os.environ.get(name)})
    return submit(args.dashboard, args.cwd, env, job)


if __name__ == "__main__":
    sys.exit(main())
