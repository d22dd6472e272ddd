"""What both Horovod bindings (torch.py, tf.py) share: importing Horovod with a hint when it is not built, its
init, checked against Ray Train's ranks, and a record of each init for tests."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

BUILD_HINT = "horovod is not installed in this environment; build it with `bash cluster/local/build-horovod.sh`"


def import_horovod(framework: str) -> Any:
    """`horovod.torch` or `horovod.tensorflow`, with the build hint instead of a bare ModuleNotFoundError."""
    try:
        return importlib.import_module({"torch": "horovod.torch", "tf": "horovod.tensorflow"}[framework])
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("horovod"):
            raise ModuleNotFoundError(BUILD_HINT) from err
        raise


def init_horovod(hvd: Any, rank: int, size: int) -> None:
    """`hvd.init()` (Gloo rendezvous with the server the backend started, or a lone process without one); checks
    Horovod agrees with Ray on who is who, since checkpoints and MLflow logging are done by Ray's rank 0."""
    hvd.init()
    if (hvd.rank(), hvd.size()) != (rank, size):
        raise RuntimeError(f"horovod rank/size {hvd.rank()}/{hvd.size()} != Ray Train's {rank}/{size}")


def record_init(directory: str | None, rank: int) -> None:
    """`run.dump_params_dir` debugging aid: one line per `hvd.init()` (rank, pid, rendezvous address), so a test
    can see that a restarted worker group did its own rendezvous."""
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    line = (f"rank={rank} pid={os.getpid()} rendezvous={os.environ.get('HOROVOD_GLOO_RENDEZVOUS_ADDR')}:"
            f"{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT')} iface={os.environ.get('HOROVOD_GLOO_IFACE')}\n")
    with open(Path(directory) / "horovod_init.log", "a") as log:
        log.write(line)
