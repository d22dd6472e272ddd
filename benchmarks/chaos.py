"""Chaos: one training run that loses nothing while faults hit it, against the same run without faults.

    python -m benchmarks.chaos [--backend ddp|tf_mwms] [--seed 0] [--events 4] [--epochs 6]

A reference `rtp train` run, then the same run (same seed, data and layout: 2 workers) with `run.resume_dir`, on a
real MLflow server, while an injector drawn from `--seed` fires `--events` faults, one at a time, each a little after
an epoch line of the run: it kills a Ray Train worker (SIGKILL; Ray Train restarts the workers from the last
checkpoint), freezes the tracking server (SIGSTOP, then SIGCONT a few seconds later; the workers' spools hold what it
missed), kills the tracking server and starts it again on the same store, or touches STOP (the run checkpoints
mid-epoch and exits 3; the injector deletes STOP and runs the same command again, which continues the run). A run
that ends while the server is away exits 1 with its records spooled; once the server is back, `rtp replay` of the
spool folder it names finishes it, as its user would. At the end the run must be FINISHED, with every epoch's metrics
logged exactly once, and its final weights (`run.dump_params_dir`) equal to the reference's: bit for bit for ddp,
within float32 rounding (1e-6) for tf_mwms (its custom loop: Keras `fit` does not watch STOP). A benchmark run on
demand, a few minutes long; the suite checks each fault on its own. Last line: `chaos=passed` or `chaos=failed
(<why>)`.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import MNIST, QUIET_ENV, ROOT, answers, ensure_mnist, free_ports

EVENTS = ("kill_worker", "freeze_server", "restart_server", "stop_and_continue")
BACKENDS = {"ddp": ["trainer=ddp"], "tf_mwms": ["trainer=tf_mwms", "trainer.tf_loop=custom"]}


class Server:
    """A real `mlflow server` on one port and sqlite store, which the injector freezes, kills and restarts."""

    def __init__(self, base: Path):
        self.base, self.port = base, free_ports(1)[0]
        self.url, self.proc = f"http://127.0.0.1:{self.port}", None

    def start(self) -> None:
        log = open(self.base / "server.log", "a")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.base}/mlflow.db", "--artifacts-destination",
             str(self.base / "artifacts")], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + 120
        while not answers(f"{self.url}/health"):
            if time.monotonic() > deadline:
                raise RuntimeError("mlflow server did not start")
            time.sleep(0.5)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def train(overrides: list[str], server: Server, on_line=None) -> subprocess.Popen:
    """`python -m pipelines.train` on its own local Ray, its output lines handed to `on_line` as they come."""
    env = {**os.environ, **QUIET_ENV, "MLFLOW_TRACKING_URI": server.url}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.train", *overrides], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.lines = []

    def read() -> None:
        for line in proc.stdout:
            proc.lines.append(line)
            if on_line is not None:
                on_line(line)
    proc.reader = threading.Thread(target=read, daemon=True)
    proc.reader.start()
    return proc


class Injector:
    """Fires the planned faults, each a random 0.5-2.5 s after a new epoch line, none after epoch `last`; after a
    STOP, none until the continued attempt prints an epoch line (so that every STOP stops an attempt)."""

    def __init__(self, plan: list[str], rng: random.Random, server: Server, resume_dir: Path, last: int):
        self.plan, self.rng, self.server, self.resume_dir, self.last = plan, rng, server, resume_dir, last
        self.fired: list[str] = []
        self.lock = threading.Lock()
        self.stopping = False  # STOP is set: this attempt is ending

    def new_attempt(self) -> None:
        self.stopping = False

    def on_line(self, line: str) -> None:
        found = re.search(r"epoch (\d+)/\d+:", line)
        if found and int(found[1]) <= self.last and self.plan and not self.stopping:
            threading.Thread(target=self.fire, daemon=True).start()

    def fire(self) -> None:
        with self.lock:
            if not self.plan or self.stopping:
                return
            event = self.plan.pop(0)
            time.sleep(self.rng.uniform(0.5, 2.5))
            getattr(self, event)()
            self.fired.append(event)

    def kill_worker(self) -> None:
        found = subprocess.run(["pgrep", "-f", "RayTrainWorker"], capture_output=True, text=True).stdout.split()
        if found:
            os.kill(int(self.rng.choice(found)), signal.SIGKILL)

    def freeze_server(self) -> None:
        self.server.signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(2, 5))
        self.server.signal(signal.SIGCONT)

    def restart_server(self) -> None:
        self.server.stop()
        time.sleep(self.rng.uniform(1, 3))
        self.server.start()

    def stop_and_continue(self) -> None:
        (self.resume_dir / "STOP").touch()
        self.stopping = True


def replay_folder(lines: list[str]) -> str | None:
    """The spool folder a run that ended while the server was away names in its error line, or None."""
    found = [re.search(r"replay them with `rtp replay (\S+)`", line) for line in lines]
    return next((f[1] for f in reversed(found) if f), None)


def replay(folder: str, server: Server, injector: Injector) -> int:
    """`rtp replay` of `folder` once the fault under way has ended and the server answers again."""
    with injector.lock:  # the fault that fired last has run its course (a restart: the server is up)
        pass
    deadline = time.monotonic() + 120
    while not answers(f"{server.url}/health") and time.monotonic() < deadline:
        time.sleep(0.5)
    env = {**os.environ, **QUIET_ENV, "MLFLOW_TRACKING_URI": server.url}
    return subprocess.run([sys.executable, "-m", "pipelines.replay", folder], cwd=ROOT, env=env).returncode


def final_weights(folder: Path) -> list[np.ndarray]:
    """Rank 0's final parameters as `run.dump_params_dir` holds them (PyTorch state dict, or TF's arrays)."""
    if (folder / "rank0.pt").is_file():
        import torch

        return [v.numpy() for _, v in sorted(torch.load(folder / "rank0.pt").items())]
    with np.load(folder / "rank0.npz") as dump:
        return [dump[f"arr_{i}"] for i in range(len(dump.files))]


def check(server: Server, run_id: str, epochs: int, reference: Path, chaos: Path, exact: bool) -> str | None:
    """Why the chaos run broke the contract, or None."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.url)
    run = client.get_run(run_id)
    if run.info.status != "FINISHED":
        return f"the run is {run.info.status}"
    for name in ("train_loss", "test_accuracy", "epoch_time_s"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, name))
        if steps != list(range(1, epochs + 1)):
            return f"{name} was logged at epochs {steps}"
    for ours, theirs in zip(final_weights(chaos), final_weights(reference), strict=True):
        if (exact and not np.array_equal(ours, theirs)) or not np.allclose(ours, theirs, rtol=0, atol=1e-6):
            return f"final weights differ from the reference's by {np.abs(ours - theirs).max():.3g}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="ddp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--events", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    ensure_mnist()
    rng = random.Random(args.seed)
    plan = [rng.choice(EVENTS) for _ in range(args.events)]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        server = Server(base)
        server.start()
        common = [f"data.path={MNIST}", *BACKENDS[args.backend], "model.hidden=[64]", "model.dropout=0",
                  f"trainer.epochs={args.epochs}", "trainer.batch_size=64", "trainer.max_steps_per_epoch=400",
                  f"fault.max_failures={args.events + 1}", f"run.storage_path={base / 'ray'}",
                  "run.system_metrics=false"]
        try:
            reference = train([*common, f"run.dump_params_dir={base / 'reference'}"], server)
            if reference.wait() != 0:
                print("".join(reference.lines[-30:]))
                raise RuntimeError("the reference run failed")
            resume_dir = base / "resume"
            resume_dir.mkdir()
            injector = Injector(list(plan), rng, server, resume_dir, last=args.epochs - 2)
            overrides = [*common, f"run.dump_params_dir={base / 'chaos'}", f"run.resume_dir={resume_dir}"]
            attempts, stops, replays, run_id = 0, 0, 0, None
            while True:
                proc = train(overrides, server, injector.on_line)
                code = proc.wait()
                proc.reader.join()
                attempts += 1
                ids = [line.split("=", 1)[1].strip() for line in proc.lines if line.startswith("mlflow_run_id=")]
                run_id = ids[-1] if ids else run_id
                if code == 3:  # stopped on request: continue it
                    stops += 1
                    (resume_dir / "STOP").unlink(missing_ok=True)
                    injector.new_attempt()
                    continue
                spooled = replay_folder(proc.lines) if code == 1 else None
                if spooled is not None and replay(spooled, server, injector) == 0:  # the server was away at its end
                    replays += 1
                    break
                if code != 0:
                    print("".join(proc.lines[-30:]))
                    print(f"chaos=failed (attempt {attempts} exited {code})")
                    return 1
                break
            why = check(server, run_id, args.epochs, base / "reference", base / "chaos", exact=args.backend == "ddp")
        finally:
            server.stop()
    print(f"backend={args.backend} seed={args.seed} planned={plan} fired={injector.fired} attempts={attempts} "
          f"stops={stops} replays={replays}")
    print("chaos=passed" if why is None else f"chaos=failed ({why})")
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
