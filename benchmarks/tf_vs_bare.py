"""Our TF pipeline (Ray TensorflowTrainer, tf-keras `fit`) against bare tf-keras `model.fit` on the same model,
batch and data, in one run; also 2 workers (MultiWorkerMirroredStrategy) vs 1 (TF's default strategy: with one
replica there is nothing to mirror, see trainers/tf_mwms.make_strategy).

    python -m benchmarks.tf_vs_bare [--epochs 4] [--model mlp] [--loop fit]

Throughput is the mean of epochs 2..N. Last line: `ratio=<ray 1 worker / bare>`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "mnist" / "parquet"


def bare_keras(model: str, batch: int, epochs: int, steps_per_execution: int) -> list[float]:
    """Plain tf-keras fit in this process (needs TF_USE_LEGACY_KERAS=1 before TF is imported)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf
    import tf_keras as keras

    from pipelines.config import load_config
    from pipelines.data.mnist import MEAN, STD
    from pipelines.data.shards import read_manifest, shard_paths
    from trainers.models.keras_models import build_keras_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    cfg = load_config([f"data.path={DATA}", f"model={model}"])
    table = pa.concat_tables(pq.read_table(p) for p in shard_paths(DATA, read_manifest(DATA), "train"))
    images = table.column("image").combine_chunks().flatten().to_numpy().reshape(-1, 784)
    labels = table.column("label").to_numpy().astype(np.int64)
    ds = (tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(len(labels), seed=0)
          .batch(batch).map(lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MEAN) / STD, y)).prefetch(2))
    net = build_keras_model(cfg.model, keras)
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
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
               "RAY_TRAIN_ENABLE_PROGRESS_BAR": "0", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
        env.pop("RAY_ADDRESS", None)
        cmd = [sys.executable, "-m", "pipelines.train", "trainer=tf_mwms", f"model={model}",
               f"data.path={DATA}", f"trainer.epochs={epochs}", f"trainer.num_workers={workers}",
               f"trainer.batch_size={batch}", f"trainer.tf_loop={loop}", f"trainer.tf_steps_per_execution={spe}",
               f"run.storage_path={tmp}/ray"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pipeline failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        run_id = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
        history = MlflowClient(uri).get_metric_history(run_id, "samples_per_s")
        return [m.value for m in sorted(history, key=lambda m: m.step)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--loop", default="fit", choices=["fit", "custom"])
    parser.add_argument("--steps-per-execution", type=int, default=8, help="for both sides")
    parser.add_argument("--bare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_only:  # the child process: print the per-epoch rates as JSON
        print(json.dumps(bare_keras(args.model, args.batch, args.epochs, args.steps_per_execution)))
        return 0
    if not (DATA / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "pipelines.prepare", "mnist", "--out", str(DATA)], check=True)
    # tf-keras must be selected before TensorFlow is imported: run the bare loop in its own process.
    child = subprocess.run([sys.executable, "-m", "benchmarks.tf_vs_bare", "--bare-only", f"--model={args.model}",
                            f"--batch={args.batch}", f"--epochs={args.epochs}",
                            f"--steps-per-execution={args.steps_per_execution}"], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                                           "OMP_NUM_THREADS": "1"}, check=True)
    bare = json.loads(child.stdout.strip().splitlines()[-1])
    spe = args.steps_per_execution
    one = ray_pipeline(args.model, args.batch, args.epochs, 1, args.loop, spe)
    two = ray_pipeline(args.model, args.batch, args.epochs, 2, args.loop, spe)
    bare_rate, one_rate, two_rate = (float(np.mean(r[1:])) for r in (bare, one, two))
    print(f"model={args.model} batch={args.batch} per replica, loop={args.loop}, steps_per_execution={spe}, "
          f"mean of epochs 2..{args.epochs}")
    print(f"bare tf-keras fit, 1 thread:          {bare_rate:9.0f} samples/s")
    print(f"Ray TensorflowTrainer, 1 worker (TF's default strategy): {one_rate:9.0f} samples/s")
    print(f"Ray TensorflowTrainer + MWMS, 2 workers: {two_rate:8.0f} samples/s global ({two_rate / one_rate:.2f}x)")
    print(f"ratio={one_rate / bare_rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
