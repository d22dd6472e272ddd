"""The TensorFlow recipe (and evaluation) measured in this (fresh) process, for tests/unit/test_tf_recipe.py to assert:

    python -m tests.support.tf_recipe_checks FOLDER

Prints the measurements as JSON on its last line. The models are tf_mwms adapters (trainers/tf/tf_mwms.py) on one
MirroredStrategy over two logical CPU devices, so that gradients really are summed across replicas; several
adapters share it (a process can split its CPU once). Needs TF_USE_LEGACY_KERAS=1 from process start.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from pipelines.data.mnist import mnist_schema
from tests.support.loop_harness import config, mnist_columns, plain_context

BASE = ["trainer=tf_mwms", "trainer.tf_loop=custom", "trainer.devices_per_worker=2", "trainer.num_workers=1",
        "trainer.batch_size=16", "trainer.epochs=1", "model.hidden=[32]", "model.dropout=0"]
SCHEDULES = {"cosine": 3, "linear": 2}  # schedule: warmup steps (2 epochs of 5 batches, 2 per update: 6 updates)


def flat(weights: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([w.ravel() for w in weights])


def learning_rates(folder: Path, keras, tf, schedule: str, warmup: int, updates: int) -> list[float]:
    """The LR the optimizer applies at each of `updates` updates (zero gradients: only the counter moves)."""
    from trainers.tf.recipe import make_optimizer

    cfg = config(folder / schedule, [*BASE, "trainer.optimizer=sgd", "trainer.lr=0.1", "trainer.epochs=2",
                                     "trainer.grad_accum=2", f"trainer.lr_schedule={schedule}",
                                     f"trainer.warmup_steps={warmup}"])
    variable = tf.Variable([1.0])
    optimizer = make_optimizer(keras, cfg.trainer, [variable], steps_per_epoch=5)

    @tf.function  # in a graph, as the training steps run it
    def update():
        optimizer.apply_gradients([(tf.zeros([1]), variable)])

    rates = []
    for _ in range(updates):
        update()
        rates.append(float(optimizer.learning_rate))  # computed from `iterations` as the update began
    return rates


def adapter(folder: Path, name: str, overrides: list[str], data, strategy=None):
    from trainers.adapter import WorkerData
    from trainers.tf.tf_mwms import MWMS

    return MWMS().build_adapter(config(folder / name, [*BASE, *overrides]), plain_context(),
                         WorkerData(mnist_schema(), lambda seed: data), strategy)


def decay_exclusion(tf, model) -> dict:
    """AdamW (lr 0.1, weight_decay 0.1) on zero gradients: Adam's step is 0, what moves is the decay. Every
    weight is 1 first (biases start at 0, where decay could not show)."""
    model.set_weights([np.ones_like(w) for w in model.get_weights()])
    before = [v.numpy() for v in model.trainable_variables]
    def zero_step():
        model.optimizer.apply_gradients([(tf.zeros_like(v), v) for v in model.trainable_variables])

    tf.function(lambda: model.distribute_strategy.run(zero_step))()
    ratios = {}
    for variable, old in zip(model.trainable_variables, before):
        ratios.setdefault(f"ndim{variable.shape.rank}", []).append(float(np.max(np.abs(variable.numpy() / old - 1))))
    return ratios


def accumulated_clipped_steps(folder: Path, data, strategy) -> dict:
    """SGD (no momentum, lr 0.5), gradients clipped to norm 1e-3, grad_accum=2, over an epoch of 3 batches (the
    last group short): the custom loop batch by batch (the weight change after each batch and at the epoch's
    end), and Keras `fit` over the same epoch from the same initial weights. Then an epoch of 5 batches batch by
    batch and in calls of 1 and 4 (`train_steps`): the second call completes the group the first began, runs a
    whole group in one compiled call, and begins the last group."""
    recipe = ["trainer.optimizer=sgd", "trainer.momentum=0", "trainer.lr=0.5", "trainer.grad_clip=0.001",
              "trainer.grad_accum=2", "trainer.max_steps_per_epoch=3"]
    custom = adapter(folder, "custom", recipe, data, strategy)
    weights = [flat(custom.model.get_weights())]
    for batch in custom.batches(1, 0):
        custom.train_step(batch)
        weights.append(flat(custom.model.get_weights()))
    custom.finish_epoch()
    weights.append(flat(custom.model.get_weights()))
    fit = adapter(folder, "fit", [*recipe, "trainer.tf_loop=fit"], data, strategy)
    fit.fit(1, 1, [])
    five = [*recipe, "trainer.max_steps_per_epoch=5"]
    by_batch = adapter(folder, "by-batch", five, data, strategy)
    in_calls = adapter(folder, "in-calls", five, data, strategy)
    for batch in by_batch.batches(1, 0):
        by_batch.train_step(batch)
    turns = list(in_calls.batches(1, 0))
    in_calls.train_steps(turns[:1])
    in_calls.train_steps(turns[1:])
    for run in (by_batch, in_calls):
        run.finish_epoch()
    return {"moved": [float(np.linalg.norm(after - before)) for before, after in zip(weights, weights[1:])],
            "iterations": [int(run.model.optimizer.iterations.numpy()) for run in (custom, fit, by_batch, in_calls)],
            "custom": weights[-1].tolist(), "fit": flat(fit.model.get_weights()).tolist(),
            "by_batch": flat(by_batch.model.get_weights()).tolist(),
            "in_calls": flat(in_calls.model.get_weights()).tolist()}


def profiles(folder: Path, keras, data, strategy) -> dict:
    """`trainer.profile_steps=2` through the shared loop on rank 0, in the custom loop and in Keras `fit` (one step
    per compiled call): the names of the events TensorFlow's profiler recorded on the host (XPlane), how often
    each, and what the loop handed to the logger."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from tests.support.loop_harness import Recorder, make_context, with_callbacks
    from trainers.callbacks.profiling import Profiling
    from trainers.tf.keras_fit import run_epochs

    found = {}
    for kind in ("custom", "fit"):
        model = adapter(folder, f"profile-{kind}", [f"trainer.tf_loop={kind}", "trainer.tf_steps_per_execution=1",
                                                    "trainer.max_steps_per_epoch=5"], data, strategy)
        recorder, trace = Recorder(), folder / f"profile-{kind}"
        ctx = with_callbacks(make_context(0, 1, 1, folder / f"checkpoints-{kind}", recorder, []), Profiling(trace, 2))
        run_epochs(keras, model, ctx, kind)
        counts: dict[str, int] = {}
        for path in trace.rglob("*.xplane.pb"):
            space = xplane_pb2.XSpace.FromString(path.read_bytes())
            for plane in space.planes:
                names = {key: meta.name for key, meta in plane.event_metadata.items()}
                for event in (event for line in plane.lines for event in line.events):
                    name = names.get(event.metadata_id, "")
                    counts[name] = counts.get(name, 0) + 1
        found[kind] = {"files": [str(p.relative_to(trace)) for p in trace.rglob("*.xplane.pb")],
                       "events": counts, "artifacts": [[f, p] for f, p in recorder.artifacts]}
    return found


def dropout_by_rank(folder: Path, data, strategy) -> list[float]:
    """The loss of one training step on the same batch and initial weights with dropout 0.5, for adapters built
    as ranks 0, 1 and 0 again (trainers/tf/adapter.seed_dropout): the masks of each rank, and their repeat."""
    from trainers.adapter import WorkerData
    from trainers.tf.tf_mwms import MWMS

    losses = []
    for run, rank in enumerate((0, 1, 0)):
        cfg = config(folder / f"dropout-{run}", [*BASE, "model.dropout=0.5", "trainer.max_steps_per_epoch=1"])
        model = MWMS().build_adapter(cfg, plain_context(rank), WorkerData(mnist_schema(), lambda seed: data), strategy)
        model.seed = cfg.run.seed  # rank 0's shuffle: the same first batch for every rank
        losses.append(model.train_step(next(iter(model.batches(1, 0))))[0])
    return losses


def evaluations(folder: Path, strategy) -> dict:
    """Three evaluations of one adapter in a row (trainers/tf/adapter.KerasAdapter.evaluate: one pass each from an
    iterator kept between them) on 300 rows (a full batch and a short one), and the count of right answers the
    model gives on all of them at once."""
    from trainers.tf.data import ShardArrays

    columns = mnist_columns(300, seed=2)
    data = (ShardArrays.from_columns(mnist_columns(160, 0), mnist_schema()),
            ShardArrays.from_columns(columns, mnist_schema()))
    model = adapter(folder, "evaluations", [], data, strategy)
    logits = model.model.predict(mnist_schema().features.model_input(columns["image"]), verbose=0)
    return {"calls": [list(model.evaluate(epoch)) for epoch in (1, 2, 3)],
            "reference": int(np.sum(np.argmax(logits, axis=1) == columns["label"]))}


def chained_epochs_memory() -> dict:
    """What opening an iterator over 20 chained epochs of a 20,000-image shard (and reading a batch) adds to this
    process's resident memory, next to the shard's size."""
    import tensorflow as tf

    from trainers.tf.data import ShardArrays, chained_epochs

    def resident_bytes() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    shard = ShardArrays.from_columns(mnist_columns(20_000, seed=3), mnist_schema())
    before = resident_bytes()
    batches = iter(chained_epochs(lambda epoch: shard.dataset(tf, 128, seed=epoch, steps=156), 1, 20))
    next(batches)
    return {"added": resident_bytes() - before, "shard": shard.features.nbytes}


def main(folder: str) -> None:
    import tensorflow as tf

    from trainers.tf.data import ShardArrays
    from trainers.tf.tf_mwms import make_strategy

    base = Path(folder)
    strategy = make_strategy(tf, config(base / "strategy", BASE).trainer)  # first: it splits the CPU
    import tf_keras as keras

    data = tuple(ShardArrays.from_columns(mnist_columns(rows, seed), mnist_schema())
                 for rows, seed in ((160, 0), (32, 1)))
    adamw = adapter(base, "adamw", ["trainer.optimizer=adamw", "trainer.lr=0.1", "trainer.weight_decay=0.1"],
                    data, strategy)
    result = {"lr": {name: learning_rates(base, keras, tf, name, warmup, 8) for name, warmup in SCHEDULES.items()},
              "decay": decay_exclusion(tf, adamw.model), "steps": accumulated_clipped_steps(base, data, strategy),
              "profiles": profiles(base, keras, data, strategy), "dropout": dropout_by_rank(base, data, strategy),
              "evaluations": evaluations(base, strategy), "chained_memory": chained_epochs_memory()}
    assert "torch" not in sys.modules, "a TensorFlow worker imported torch"
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
