"""Our TF pipeline (`trainer=tf_mwms` on Ray Train, tf-keras `fit`) against bare tf-keras `model.fit` on the same model,
batch and data, in one run; also 2 workers (MultiWorkerMirroredStrategy) vs 1 (TF's default strategy: with one
replica there is nothing to mirror, see trainers/tf/tf_mwms.make_strategy).

    python -m benchmarks.tf_vs_bare [--epochs 4] [--model mlp] [--loop fit]

Throughput is the mean of epochs 2..N. Last line: `ratio=<ray 1 worker / bare>`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from pipelines.data.mnist import mnist_schema
from benchmarks.common import (MNIST, QUIET_ENV, ROOT, ensure_mnist, mnist_arrays, mnist_parser, pipeline_run,
                               steady_rate)


def bare_keras(model: str, batch: int, epochs: int, steps_per_execution: int) -> list[float]:
    """Plain tf-keras fit in this process (needs TF_USE_LEGACY_KERAS=1 before TF is imported)."""
    import tensorflow as tf
    import tf_keras as keras

    from pipelines.config import load_config
    from pipelines.data.mnist import MNIST_MEAN as MEAN, MNIST_STD as STD
    from trainers.models import build_keras_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    cfg = load_config([f"data.path={MNIST}", f"model={model}"])
    images, labels = mnist_arrays("train")
    ds = (tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(len(labels), seed=0)
          .batch(batch).map(lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MEAN) / STD, y)).prefetch(2))
    net = build_keras_model(cfg.model, keras, mnist_schema())
    net.compile(optimizer=keras.optimizers.Adam(cfg.trainer.lr),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution)
    rates: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            rates.append(len(labels) / (time.perf_counter() - self.start))

    net.fit(ds, epochs=epochs, callbacks=[Timer()], verbose=0)
    return rates


def ray_pipeline(model: str, batch: int, epochs: int, workers: int, loop: str, spe: int) -> list[float]:
    history, _ = pipeline_run(["trainer=tf_mwms", f"model={model}", f"data.path={MNIST}", f"trainer.epochs={epochs}",
                               f"trainer.num_workers={workers}", f"trainer.batch_size={batch}",
                               f"trainer.tf_loop={loop}", f"trainer.tf_steps_per_execution={spe}"])
    return history["samples_per_s"]


def main() -> int:
    parser = mnist_parser(__doc__)
    parser.add_argument("--loop", default="fit", choices=["fit", "custom"])
    parser.add_argument("--steps-per-execution", type=int, default=8, help="for both sides")
    parser.add_argument("--bare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_only:  # the child process: print the per-epoch rates as JSON
        print(json.dumps(bare_keras(args.model, args.batch, args.epochs, args.steps_per_execution)))
        return 0
    ensure_mnist()
    # tf-keras must be selected before TensorFlow is imported: run the bare loop in its own process.
    child = subprocess.run([sys.executable, "-m", "benchmarks.tf_vs_bare", "--bare-only", f"--model={args.model}",
                            f"--batch={args.batch}", f"--epochs={args.epochs}",
                            f"--steps-per-execution={args.steps_per_execution}"], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, **QUIET_ENV, "TF_USE_LEGACY_KERAS": "1"}, check=True)
    bare = json.loads(child.stdout.strip().splitlines()[-1])
    spe = args.steps_per_execution
    one = ray_pipeline(args.model, args.batch, args.epochs, 1, args.loop, spe)
    two = ray_pipeline(args.model, args.batch, args.epochs, 2, args.loop, spe)
    bare_rate, one_rate, two_rate = (steady_rate(r) for r in (bare, one, two))
    print(f"model={args.model} batch={args.batch} per replica, loop={args.loop}, steps_per_execution={spe}, "
          f"mean of epochs 2..{args.epochs}")
    print(f"bare tf-keras fit, 1 thread:          {bare_rate:9.0f} samples/s")
    print(f"Ray Train tf_mwms, 1 worker (TF's default strategy): {one_rate:9.0f} samples/s")
    print(f"Ray Train tf_mwms + MWMS, 2 workers: {two_rate:8.0f} samples/s global ({two_rate / one_rate:.2f}x)")
    print(f"ratio={one_rate / bare_rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
