"""ParameterServerStrategy (`trainer=tf_ps`: a chief, a parameter server, 2 workers) against MultiWorkerMirroredStrategy
(`trainer=tf_mwms`, 2 workers) and a bare ParameterServerStrategy loop, on the same MNIST model, batch and data, in
one run.

    python -m benchmarks.ps_vs_mwms [--epochs 5] [--model mlp] [--batch 128]
    python -m benchmarks.ps_vs_mwms --against-bare 3 [--epochs 5]

Both pipelines use Adam at 1e-3 and `--batch` rows per worker step. MWMS takes one synchronous step of 2 x batch rows
(the gradients all-reduced); PS takes asynchronous steps of `batch` rows, each worker applying its own gradient on
the parameter server, so an epoch has twice as many (smaller) updates. The bare loop is what a TensorFlow user would
write without Ray: servers in child processes (trainers/tf/ps/server.py), a `ClusterCoordinator` scheduling each
epoch's steps in functions of 8 (tf_ps' default), each worker's dataset its half of the arrays. It runs twice: with
each worker's own dropout masks (tf_ps' recipe) and with tf-keras' default dropout (every worker the same masks:
cheaper, and another model). Throughput is the mean of epochs 2..N (global samples/s). Last line:
`ratio=<tf_ps / tf_mwms samples/s>`.

`--against-bare N`: only `tf_ps` and the bare loop with the same recipe, N rounds of bare then ours in turn; last
line `ratio=<tf_ps / bare PS>`, the median of the rounds' ratios.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from pipelines.data.mnist import mnist_schema
from benchmarks.common import MNIST, QUIET_ENV, ROOT, alternated, ensure_mnist, free_ports, mnist_arrays, \
    mnist_parser, pipeline_run, steady_rate

WORKERS = 2
STEPS_PER_FUNCTION = 8  # tf_ps' default trainer.tf_steps_per_execution


def bare_ps(model: str, batch: int, epochs: int, own_masks: bool) -> list[float]:
    """Samples/s of each epoch of a plain ClusterCoordinator loop (this process is the chief). `own_masks`: each
    worker draws its own dropout masks, as tf_ps' do (a `tf.random.Generator` per dropout layer, its state on the
    parameter server); without it tf-keras' default dropout gives every worker the same masks (the seeds are fixed
    when the chief traces the step), which costs less and trains a different model."""
    import tensorflow as tf
    import tf_keras as keras

    from pipelines.data.mnist import MNIST_MEAN, MNIST_STD
    from pipelines.config import load_config
    from trainers.models import build_keras_model

    ports = free_ports(2 + WORKERS)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
               "worker": [f"127.0.0.1:{port}" for port in ports[2:]]}
    servers = [subprocess.Popen([sys.executable, "-m", "trainers.tf.ps.server"], cwd=ROOT,
                                env={**os.environ, **QUIET_ENV, "TF_PS_PARENT": str(os.getpid()), "TF_CONFIG":
                                     json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})})
               for kind in ("ps", "worker") for index in range(len(cluster[kind]))]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        images, labels = mnist_arrays("train")
        cfg = load_config([f"data.path={MNIST}", f"model={model}"])
        if own_masks:
            keras.backend.experimental.enable_tf_random_generator()
        with strategy.scope():
            net = build_keras_model(cfg.model, keras, mnist_schema(), seed=0)
            optimizer = keras.optimizers.Adam(1e-3)

        def dataset_fn(_):
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            ds = tf.data.Dataset.from_tensor_slices((images, labels)).shard(WORKERS, worker)
            ds = ds.shuffle(len(labels) // WORKERS).repeat().batch(batch, drop_remainder=True)
            return ds.map(lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MNIST_MEAN) / MNIST_STD, y)).prefetch(2)

        iterator = iter(coordinator.create_per_worker_dataset(
            tf.function(lambda: strategy.distribute_datasets_from_function(dataset_fn))))

        @tf.function
        def steps_fn(iterator):  # STEPS_PER_FUNCTION steps on one worker, as tf_ps schedules them
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, net(x, training=True),
                                                                                       from_logits=True))
                optimizer.apply_gradients(zip(tape.gradient(loss, net.trainable_variables), net.trainable_variables))
                return loss
            for _ in tf.range(STEPS_PER_FUNCTION):
                strategy.run(replica, args=next(iterator))

        steps, rates = len(labels) // batch // STEPS_PER_FUNCTION * STEPS_PER_FUNCTION, []
        for _ in range(epochs):
            start = time.perf_counter()
            for _ in range(steps // STEPS_PER_FUNCTION):
                coordinator.schedule(steps_fn, args=(iterator,))
            coordinator.join()
            rates.append(steps * batch / (time.perf_counter() - start))
        return rates
    finally:
        for server in servers:
            server.kill()


def bare_in_child(args, own_masks: bool) -> list[float]:
    """`bare_ps` in a child process (`--bare own|shared`): its last stdout line is `rates=<json list>`."""
    command = [sys.executable, "-m", "benchmarks.ps_vs_mwms", "--bare", "own" if own_masks else "shared",
               "--model", args.model, "--batch", str(args.batch), "--epochs", str(args.epochs)]
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, **QUIET_ENV}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1].split("=", 1)[1])


def pipeline(backend: str, args, extra: list[str]) -> tuple[dict[str, list[float]], float]:
    """(MLflow histories, wall seconds) of a 2-worker run of `backend`."""
    start = time.perf_counter()
    history, _ = pipeline_run([f"trainer={backend}", f"model={args.model}", f"data.path={MNIST}",
                               f"trainer.epochs={args.epochs}", f"trainer.num_workers={WORKERS}",
                               f"trainer.batch_size={args.batch}", "trainer.optimizer=adam", "trainer.lr=0.001",
                               "trainer.threads_per_worker=1", "run.final_model=last", *extra])
    return history, time.perf_counter() - start


def main() -> int:
    parser = mnist_parser(__doc__)
    parser.set_defaults(epochs=5)
    parser.add_argument("--bare", choices=("own", "shared"), help="only the bare loop, with each worker's own "
                        "dropout masks or tf-keras' shared ones; prints rates=<samples/s of each epoch>")
    parser.add_argument("--against-bare", type=int, metavar="N", help="only tf_ps and the bare loop with its "
                        "recipe, N rounds in turn (median of the rounds' ratios)")
    args = parser.parse_args()
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1":  # tf-keras must own tf.keras from the first TF import
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.ps_vs_mwms", *sys.argv[1:]],
                  {**os.environ, "TF_USE_LEGACY_KERAS": "1", **QUIET_ENV})
    ensure_mnist()
    if args.bare:
        print(f"rates={json.dumps(bare_ps(args.model, args.batch, args.epochs, args.bare == 'own'))}")
        return 0
    if args.against_bare:
        print(f"model={args.model} batch={args.batch} per worker step, {WORKERS} workers, epochs={args.epochs} "
              f"(mean of epochs 2..{args.epochs}): the bare PS loop (each worker its own dropout masks), then "
              f"tf_ps, {args.against_bare} round(s)", flush=True)
        ratio = alternated(args.against_bare, lambda: bare_in_child(args, True),
                           lambda: pipeline("tf_ps", args, ["trainer.num_ps=1"])[0]["samples_per_s"])
        print(f"ratio={ratio:.3f}")
        return 0
    load = os.getloadavg()[0]
    runs = {"tf_mwms (fit)": pipeline("tf_mwms", args, ["trainer.tf_loop=fit"]),
            "tf_mwms (custom)": pipeline("tf_mwms", args, ["trainer.tf_loop=custom"]),
            "tf_ps (custom)": pipeline("tf_ps", args, ["trainer.num_ps=1"])}
    # Each bare loop in a process of its own: tf-keras' random-generator switch is process-wide.
    bare = {own: steady_rate(bare_in_child(args, own)) for own in (True, False)}
    print(f"model={args.model} batch={args.batch} per worker step, {WORKERS} workers, epochs={args.epochs} "
          f"(samples/s: mean of epochs 2..{args.epochs}); load average before: {load:.1f}")
    print("| run | samples/s (global) | test accuracy, last epoch | best epoch's | wall time (s) |")
    print("|---|---|---|---|---|")
    for name, (history, wall) in runs.items():
        accuracy = history["test_accuracy"]
        print(f"| {name} | {steady_rate(history['samples_per_s']):,.0f} | {100 * accuracy[-1]:.2f}% | "
              f"{100 * max(accuracy):.2f}% (epoch {int(np.argmax(accuracy)) + 1}) | {wall:.0f} |")
    ps = steady_rate(runs["tf_ps (custom)"][0]["samples_per_s"])
    print(f"| bare ParameterServerStrategy (no Ray), each worker its own dropout masks | {bare[True]:,.0f} | | | |")
    print(f"| bare ParameterServerStrategy (no Ray), tf-keras' default dropout: the same masks on every worker | "
          f"{bare[False]:,.0f} | | | |")
    print(f"tf_ps / bare PS: {ps / bare[True]:.3f} (the same recipe); {ps / bare[False]:.3f} (default dropout)")
    print(f"ratio={ps / steady_rate(runs['tf_mwms (fit)'][0]['samples_per_s']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
