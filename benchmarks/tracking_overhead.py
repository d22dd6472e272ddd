"""What MLflow tracking costs a training step: the same run with step logging and system metrics on, and off,
against a real `mlflow server` over HTTP, in one run. Epoch metrics are logged either way (between epochs,
outside the timed steps).

    python -m benchmarks.tracking_overhead [--model mlp] [--epochs 3] [--repeats 7] [--every 10] [--set ...]

Pairs alternate (on, off, on, off, ...) so drifting machine load hits both; each run's figure is its steady step
time (mean of epochs 2..N). The overhead is the median over the pairs of on/off - 1, printed with a
distribution-free confidence interval for that median (order statistics of the pair ratios, at least 90%): on a
loaded machine single pairs move by more than a small overhead, so the interval says what the run can and cannot
tell.
Last line: `overhead=<median over pairs of on/off - 1>`.

    python -m benchmarks.tracking_overhead --account [--epochs 12] [--window 20] [--set trainer=tf_mwms ...]

With `--account`: what tracking takes, counted rather than compared (an on/off comparison of step times on a
loaded machine cannot resolve a cost of a few percent: benchmarks/README.md, tracking_overhead). Two runs, tracking
on then off, each sampled for `--window` seconds from its first logged epoch: py-spy samples the driver and both
workers (every thread, idle ones included), and /proc counts each thread's CPU time and the MLflow server's.
Printed per worker: the share of its training passes' wall time spent in the step-loss hook
(`TrainLoop.log_step_loss`: the loss's all-reduce, and rank 0's logger); then the CPU of the tracking threads
(MLflow's system metrics monitors), and what the server and Horovod TF's reducer thread took more than with
tracking off, as a share of the cores. Last line: `overhead_accounted=<the larger hook share + that CPU share>`.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
from mlflow.tracking import MlflowClient

from benchmarks.common import MNIST, ensure_mnist, mlflow_server, pipeline_run, steady_rate
# The thread that issues Horovod TF's all-reduces off the training thread (`tf_reduce_later`): step losses when
# tracking is on, the stop agreement and epoch metrics either way.
from trainers.horovod.tf import METRICS_THREAD as REDUCER_THREAD


def step_time_ms(uri: str, args: argparse.Namespace, tracking: bool) -> float:
    history, _ = pipeline_run([f"model={args.model}", f"data.path={MNIST}", f"trainer.epochs={args.epochs}",
                               "trainer.num_workers=2", f"trainer.log_every_n_steps={args.every if tracking else 0}",
                               f"run.system_metrics={str(tracking).lower()}", *args.set], tracking_uri=uri)
    return steady_rate(history["step_time_ms"])


def median_interval(values: list[float], coverage: float = 0.9) -> tuple[float, float, float]:
    """(low, high, confidence) of the narrowest order-statistic interval [x_(k), x_(n+1-k)] that holds the median
    with at least `coverage` whatever the distribution: confidence = 1 - 2 P(Binomial(n, 1/2) < k). The widest
    interval (k = 1) when even that falls short."""
    ordered, n = sorted(values), len(values)

    def confidence(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and confidence(k + 1) >= coverage:
        k += 1
    return ordered[k - 1], ordered[n - k], confidence(k)


# Training passes: the shared loop's, or Keras `fit`'s (trainers/tf/keras_fit.py) less its epoch-end callback.
TRAINING = ("train_epoch (trainers/loop.py", "fit_epochs (trainers/tf/keras_fit.py")
EPOCH_END = "end_epoch (trainers/loop.py"
HOOK = "log_step_loss (trainers/loop.py"
LOGGER = "log_step_loss (contract/tracking/logger.py"


def processes(match: Callable[[list[str]], bool]) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if match(p.info["cmdline"] or [])]


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each of the process's threads so far, by thread id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def tree_cpu_s(root: psutil.Process) -> float:
    """CPU seconds of a process and its descendants so far (the MLflow server and its web workers)."""
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def read_samples(path: Path) -> tuple[dict[int, str], Counter]:
    """py-spy's raw output (`--threads`): each thread's name by id, and sample counts of the frames we look for
    in them: the training pass, the step-loss hook, the logger inside it."""
    names, counts = {}, Counter()
    for line in path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        head = re.match(r"thread \((\d+)\)(?:: ([^;]*))?", stack)  # a thread with no Python frames: no name
        names[int(head[1])] = head[2] or "(no Python frames)"
        if any(frame in stack for frame in TRAINING) and EPOCH_END not in stack:
            counts["training"] += int(count)
        for frame in (HOOK, LOGGER):
            counts[frame] += int(count) if frame in stack else 0
    return names, counts


def logged_runs(client: MlflowClient) -> set[str]:
    """The ids of the runs on the server that have logged an epoch."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {r.info.run_id for r in client.search_runs(experiments, filter_string="metrics.train_loss > 0")}


def wait_for_epoch_1(client: MlflowClient, earlier: set[str], run: threading.Thread) -> None:
    """Until a run not in `earlier` logs its first epoch (its workers are past their start and the shard's pull)."""
    while run.is_alive():
        if logged_runs(client) - earlier:
            return
        time.sleep(0.5)
    raise RuntimeError("the run ended before its first epoch was logged")


@dataclass
class Sampled:
    """What one run's window shows: per worker, shares of its training passes' samples; every thread's CPU-s;
    and the MLflow server's CPU-s."""
    shares: dict[str, dict[str, float]] = field(default_factory=dict)  # worker -> {"hook": share, "logger": share}
    threads: list[tuple[str, str, float, bool]] = field(default_factory=list)  # (role, name, CPU-s, tracking)
    server_cpu_s: float = 0.0
    load: float = 0.0

    def tracking_cpu_s(self) -> float:
        return sum(cpu for _, _, cpu, tracking in self.threads if tracking)

    def reducer_cpu_s(self) -> float:
        return sum(cpu for _, name, cpu, _ in self.threads if name.startswith(REDUCER_THREAD))


def sampled_run(uri: str, args: argparse.Namespace, tracking: bool) -> Sampled:
    """A pipeline run (tracking on or off) sampled from its first logged epoch for `args.window` seconds."""
    port = uri.rsplit(":", 1)[1]
    client = MlflowClient(uri)
    earlier = logged_runs(client)
    run = threading.Thread(target=step_time_ms, args=(uri, args, tracking), daemon=True)
    run.start()
    wait_for_epoch_1(client, earlier, run)
    [server] = processes(lambda cmd: "server" in cmd and "--port" in cmd and port in cmd)
    [driver] = processes(lambda cmd: cmd[1:3] == ["-m", "pipelines.train"])
    spied = [driver.pid, *(p.pid for p in processes(lambda cmd: " ".join(cmd).startswith("ray::RayTrainWorker")))]
    assert len(spied) == 3, f"expected the driver and 2 Ray Train workers, found {spied}"
    result = Sampled(load=os.getloadavg()[0])
    with tempfile.TemporaryDirectory() as tmp:
        before, server_before = {pid: thread_cpu_s(pid) for pid in spied}, tree_cpu_s(server)
        spies = [subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "--idle",
                                   "--threads", "--nonblocking", "-r", "100", "-d", str(args.window), "-f", "raw",
                                   "-o", f"{tmp}/{pid}.txt"], stdout=subprocess.DEVNULL)
                 for pid in spied]
        for spy in spies:
            spy.wait()
        after, result.server_cpu_s = {pid: thread_cpu_s(pid) for pid in spied}, tree_cpu_s(server) - server_before
        if not run.is_alive():
            raise RuntimeError(f"the run ended inside the {args.window} s window: raise --epochs")
        samples = {pid: read_samples(Path(f"{tmp}/{pid}.txt")) for pid in spied}
    run.join()
    for pid, (names, counts) in samples.items():
        role = "driver" if pid == driver.pid else f"worker {pid}"
        if role != "driver":
            rank0 = "SystemMetricsMonitor" in names.values()  # rank 0 watches its node when tracking is on
            result.shares[f"rank 0 ({pid})" if rank0 else role] = {
                name: counts[frame] / counts["training"] for name, frame in (("logger", LOGGER), ("hook", HOOK))}
        for tid, name in sorted(names.items()):
            cpu = after[pid].get(tid, 0.0) - before[pid].get(tid, 0.0)
            result.threads.append((role, name, cpu, "SystemMetrics" in name or "mlflow" in name.lower()))
    return result


def account(args: argparse.Namespace) -> int:
    with mlflow_server() as uri:
        on, off = sampled_run(uri, args, True), sampled_run(uri, args, False)
    print(f"{' '.join([f'model={args.model}', *args.set])}, 2 workers, a {args.window} s window from epoch 2 of "
          f"{args.epochs}; tracking on (load {on.load:.1f}), then off (load {off.load:.1f})")
    for label, run in (("on", on), ("off", off)):
        for worker, shares in sorted(run.shares.items()):
            print(f"{label}, {worker}: {shares['hook']:.2%} of the training passes' wall time in the step-loss hook "
                  f"(its logger {shares['logger']:.2%})")
    for role, name, cpu, tracking in on.threads:
        if cpu >= 0.01:
            print(f"  on: {role} thread {name}: {cpu:.2f} CPU-s{' (tracking)' if tracking else ''}")
    extra_cpu_s = on.server_cpu_s - off.server_cpu_s + on.reducer_cpu_s() - off.reducer_cpu_s()
    cpu_share = (on.tracking_cpu_s() + extra_cpu_s) / (args.window * os.cpu_count())
    print(f"mlflow server {on.server_cpu_s:.2f} CPU-s on, {off.server_cpu_s:.2f} off; reducer threads "
          f"{on.reducer_cpu_s():.2f} on, {off.reducer_cpu_s():.2f} off; tracking threads "
          f"{on.tracking_cpu_s():.2f} CPU-s: {cpu_share:.2%} of {os.cpu_count()} cores")
    hook = max(shares["hook"] for shares in on.shares.values())
    print(f"overhead_accounted={hook + cpu_share:.4f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--epochs", type=int, help="3; with --account 12")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--every", type=int, default=10, help="trainer.log_every_n_steps when tracking is on")
    parser.add_argument("--set", nargs="*", default=[], help="more pipelines.train overrides (trainer=tf_mwms ...)")
    parser.add_argument("--account", action="store_true", help="one run, tracking's share counted (above)")
    parser.add_argument("--window", type=int, default=20, help="--account: seconds sampled, from epoch 2")
    args = parser.parse_args()
    args.epochs = args.epochs or (12 if args.account else 3)
    ensure_mnist()
    if args.account:
        return account(args)
    on, off = [], []
    with mlflow_server() as uri:
        for _ in range(args.repeats):
            on.append(step_time_ms(uri, args, True))
            off.append(step_time_ms(uri, args, False))
            print(f"step time: tracking on {on[-1]:.2f} ms, off {off[-1]:.2f} ms; load {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"model={args.model}, 2 workers, step_loss every {args.every} steps + system metrics vs neither; "
          f"median of {args.repeats}: on {np.median(on):.2f} ms, off {np.median(off):.2f} ms")
    ratios = list(np.array(on) / np.array(off) - 1)
    low, high, confidence = median_interval(ratios)
    print("pairs: " + ", ".join(f"{r:+.1%}" for r in ratios))
    print(f"median overhead {np.median(ratios):+.1%}, {confidence:.0%} interval for it [{low:+.1%}, {high:+.1%}]")
    print(f"overhead={np.median(ratios):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
