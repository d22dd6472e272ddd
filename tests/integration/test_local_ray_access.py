"""Who can use a local Ray: the head cluster/local/ray-local.sh starts (the demo's, and this suite's) and the Ray a
driver starts by itself when RAY_ADDRESS is unset (pipelines/ray_session.py). Every port their processes listen on,
workers and the driver included, is bound to loopback, and a request without the head's token is refused. Traffic
goes to loopback only."""
from __future__ import annotations

import ast
import ipaddress
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import CLIENT_SETTINGS, ROOT, pipeline_env

pytestmark = pytest.mark.slow

# A driver that keeps an actor alive (so the cluster has a worker process) until its stdin closes.
DRIVER = """
import json, os, sys, ray
from pipelines.fit import init_ray

init_ray(2)

@ray.remote(num_cpus=0)
class Worker:
    def pid(self):
        return os.getpid()

worker = Worker.remote()
print(json.dumps({"driver": os.getpid(), "worker": ray.get(worker.pid.remote()),
                  "gcs": ray.get_runtime_context().gcs_address}), flush=True)
sys.stdin.read()
"""


@contextmanager
def driver_holding_a_worker(env: dict[str, str]) -> Iterator[dict]:
    """`pipelines.fit.init_ray` (what `pipelines.train` and the sweep call) in a driver of its own; yields the
    driver's and its worker's pids and the GCS address while both live."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        yield json.loads(line)
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def listening_sockets(pids: set[int]) -> list[tuple[int, str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(pid, command, address, port) of every TCP socket in LISTEN state the processes hold, from their open file
    descriptors and /proc/net/tcp{,6}."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].split(":")
                listening[fields[9]] = (kernel_address(address), int(port, 16))
    found = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/comm").read_text().strip()
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # the process ended meanwhile
            continue
        for link in links:
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in listening:
                found.append((pid, command, *listening[inode]))
    return found


def kernel_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def all_pids() -> set[int]:
    return {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    family, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        children = {child for child, of in parents.items() if of == parent}
        todo.extend(children - family)
        family |= children
    return family


def session_of(pid: int) -> set[int]:
    """Every process of `pid`'s session (ray-local.sh starts its head in a session of its own)."""
    def sid(stat: Path) -> int | None:
        try:
            return int(stat.read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError):
            return None
    own = sid(Path(f"/proc/{pid}/stat"))
    return {int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat") if sid(stat) == own}


def environment(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    entries = Path(f"/proc/{pid}/environ").read_text().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def gcs_call(address: str, token: str | None) -> str:
    """The status of a GetAllNodeInfo request to the GCS at `address`, with the token or without."""
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
                                   request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        try:
            call(b"", metadata=metadata, timeout=30)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name


def http_status(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def assert_all_on_loopback(pids: set[int], expected_ports: set[int]) -> None:
    sockets = listening_sockets(pids)
    assert expected_ports <= {port for *_, port in sockets}, sockets  # the check sees the cluster's own ports
    assert [s for s in sockets if not is_loopback(s[2])] == []


def test_the_local_head_and_its_workers_listen_on_loopback_only_and_want_the_token(ray_head):
    gcs_port = int(ray_head["RAY_ADDRESS"].rsplit(":", 1)[1])
    [gcs] = [pid for pid, command, _, port in listening_sockets(all_pids())
             if port == gcs_port and command == "gcs_server"]
    with driver_holding_a_worker(pipeline_env("unused", ray_head)) as ray:
        head = session_of(gcs)
        assert ray["worker"] in head  # the head's workers are in its session, and so checked
        assert_all_on_loopback(head | {ray["driver"]}, {gcs_port, gcs_port + 1, gcs_port + 2})

    token_file = Path(ray_head["RAY_AUTH_TOKEN_PATH"])
    assert token_file.stat().st_mode & 0o077 == 0
    token = token_file.read_text().strip()
    assert gcs_call(ray_head["RAY_ADDRESS"], None) == "UNAUTHENTICATED"
    assert gcs_call(ray_head["RAY_ADDRESS"], token) == "OK"
    jobs = f"{ray_head['RAY_DASHBOARD_ADDRESS']}/api/jobs/"  # what `ray job submit` talks to
    assert (http_status(jobs, None), http_status(jobs, token)) == (401, 200)


def test_the_ray_a_driver_starts_by_itself_listens_on_loopback_only_and_wants_its_token():
    env = pipeline_env("unused")
    for name in (*CLIENT_SETTINGS, "RAY_AUTH_TOKEN"):  # nothing set beforehand: the driver's own doing
        env.pop(name, None)
    with driver_holding_a_worker(env) as ray:
        family = descendants(ray["driver"])
        assert ray["worker"] in family
        gcs_port = int(ray["gcs"].rsplit(":", 1)[1])
        assert_all_on_loopback(family, {gcs_port})
        [gcs] = [pid for pid, command, _, port in listening_sockets(family) if port == gcs_port]
        token = environment(gcs)["RAY_AUTH_TOKEN"]  # the driver gave it to the Ray processes it started
        assert gcs_call(ray["gcs"], None) == "UNAUTHENTICATED"
        assert gcs_call(ray["gcs"], token) == "OK"


def test_every_local_ray_is_started_through_start_local_ray():
    """`ray.init` without a cluster's address (which starts a Ray) only in pipelines/ray_session.py, so that
    evaluate, predict and prepare get the same loopback and token as training (the tests above)."""
    starts = []
    for layer in ("pipelines", "trainers", "contract"):
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "ray.init":
                    address = next((k.value for k in node.keywords if k.arg == "address"), None)
                    if address is None or isinstance(address, ast.Constant):
                        starts.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(starts) == 1 and starts[0].startswith("pipelines/ray_session.py:"), starts
