"""One TensorFlow server of a `trainer=tf_ps` cluster (a parameter server or a worker), as its own process:

    python -m trainers.tf.ps.server        # TF_CONFIG in the environment names the cluster and this task

A Ray Train worker of the tf_ps backend starts this process and watches it (`ServerProcess` in
trainers/tf/ps/cluster.py): a worker server that dies is started again at the same address, and ClusterCoordinator
gives its steps to the other workers meanwhile and rebuilds its dataset when it is back. That is why the server is
not the Ray worker itself: Ray Train ends the whole run when one of its workers dies. The server dies with the
process that started it (PR_SET_PDEATHSIG), so a Ray worker killed by Ray Train leaves no server holding its port.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None) -> None:
    """The kernel sends SIGKILL when the thread that started this process ends (Linux). A parent (pid `parent`)
    already gone before that was asked: exit now."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        sys.exit(f"tf_ps server: its parent {parent} has gone")


def set_threads(intra_op: int, inter_op: int) -> None:
    """This process's TensorFlow thread pools, before its first server starts."""
    from contract.console import import_tensorflow

    tf = import_tensorflow()  # with its start-up lines filtered

    tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def start_server(tf_config: str) -> Any:
    """Start the TensorFlow server of the task that `tf_config` (a TF_CONFIG) names, in this process; returns it."""
    import tensorflow as tf

    spec = json.loads(tf_config)
    task = spec["task"]
    server = tf.distribute.Server(tf.train.ClusterSpec(spec["cluster"]), job_name=task["type"],
                                  task_index=task["index"], protocol="grpc", start=True)
    print(f"tf_ps server {task['type']}:{task['index']} serving at {server.target}", flush=True)
    return server


if __name__ == "__main__":
    die_with_parent(int(os.environ["TF_PS_PARENT"]) if "TF_PS_PARENT" in os.environ else None)
    threads = int(os.environ.get("TF_PS_THREADS", "1"))
    # Workers run the steps (intra-op threads: `trainer.threads_per_worker`); inter-op threads leave room for the
    # coordinator's concurrent calls (with an inter-op pool of 1 the coordinator hangs).
    set_threads(threads, threads + 3)
    start_server(os.environ["TF_CONFIG"]).join()  # until killed
