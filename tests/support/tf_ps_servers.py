"""Several TensorFlow servers of a tf_ps cluster (trainers/tf/ps/server.py's) in this one process, for the loop
tests without Ray (tests/support/loop_backends.ps_cluster: a worker with the parameter servers, or a worker alone):

    python -m tests.support.tf_ps_servers THREADS TF_CONFIG [TF_CONFIG ...]

One TensorFlow import (4.6 CPU-s here) instead of one per server. (Two workers in one process hung here.) The Ray
backend runs each server in a process of its own, where one can die alone: tests/integration/test_tf_ps.py runs
that path. This process dies with the one that started it (TF_PS_PARENT, as a server of the Ray backend does)."""
from __future__ import annotations

import os
import sys

from trainers.tf.ps.server import die_with_parent, set_threads, start_server

if __name__ == "__main__":
    die_with_parent(int(os.environ["TF_PS_PARENT"]))
    threads, *tf_configs = sys.argv[1:]
    # The thread pools are the process's: each server gets the inter-op threads it has in a process of its own.
    set_threads(int(threads), (int(threads) + 3) * len(tf_configs))
    servers = [start_server(tf_config) for tf_config in tf_configs]
    servers[0].join()  # until killed
