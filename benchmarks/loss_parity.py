"""Loss parity through the whole pipeline: every data-parallel backend trains the MNIST MLP with one seed, data
order and recipe on 2 workers, and its step losses are compared with DDP's, step for step.

    python -m benchmarks.loss_parity [--steps 50] [--epochs 2] [--batch 64] [--only ddp,tf_mwms_custom]
                                     [--dropout 0.2 --only fsdp,horovod_torch]

Each backend is a `pipelines.train` run (Ray Data shards, Ray Train workers, MLflow) logging `step_loss` every
step. What makes the curves comparable: the MLP starts from the same weights in PyTorch and Keras for one seed
(trainers/models/portable_init.py), every backend shuffles its shard with the same numpy permutation (with
`data.cache_in_worker=true`, the default, under which the PyTorch backends hold their shard), dropout is off
(`--dropout p`: on; the PyTorch backends draw the same masks, trainers/torch/adapter.seed_dropout, TensorFlow its
own), and SGD with momentum runs at a constant rate (the two frameworks define momentum alike only then). The overlay
plot of the curves, with each one's distance to DDP's below it, is logged as `loss_parity.png` to an MLflow run
named `loss-parity` in the tracking store of the runs (MLFLOW_TRACKING_URI, else the pipelines' default).
The gate with a stated tolerance is a test, in-process (one worker each, no Ray):
`test_loss_parity_with_the_ddp_reference` in tests/unit/test_loop_backends.py.
Last line: `max_loss_deviation=<largest |step_loss - DDP's| of any backend>`.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import MNIST, ensure_mnist, pipeline_run

BACKENDS = {  # row name -> pipelines.train overrides
    "ddp": ["trainer=ddp"],
    "fsdp": ["trainer=fsdp"],
    "lightning": ["trainer=lightning"],
    "deepspeed_zero3": ["trainer=deepspeed", "trainer.zero_stage=3"],
    "horovod_torch": ["trainer=horovod", "trainer.framework=torch"],
    "horovod_tf": ["trainer=horovod", "trainer.framework=tf"],
    "tf_mwms_custom": ["trainer=tf_mwms", "trainer.tf_loop=custom"],
    "tf_mwms_fit": ["trainer=tf_mwms", "trainer.tf_loop=fit", "trainer.tf_steps_per_execution=1"],
}
REFERENCE = "ddp"


def recipe(args: argparse.Namespace) -> list[str]:
    return [f"data.path={MNIST}", "model=mlp", f"model.dropout={args.dropout}", "trainer.num_workers=2", "run.seed=0",
            "trainer.optimizer=sgd", "trainer.momentum=0.9", f"trainer.lr={args.lr}",
            f"trainer.batch_size={args.batch}", f"trainer.epochs={args.epochs}",
            f"trainer.max_steps_per_epoch={args.steps}", "trainer.log_every_n_steps=1", "run.system_metrics=false"]


def plot(curves: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[2, 1])
    reference = curves[REFERENCE]
    for index, (name, curve) in enumerate(curves.items()):
        steps, color = np.arange(1, len(curve) + 1), f"C{index}"  # one colour per backend in both panels
        top.plot(steps, curve, label=name, color=color, linewidth=2.5 if name == REFERENCE else 1.2,
                 linestyle="-" if name == REFERENCE else "--")
        if name != REFERENCE:  # an identical curve shows at the floor, 1e-12
            bottom.semilogy(steps, np.abs(curve - reference) + 1e-12, label=name, color=color)
    top.set_ylabel("step_loss")
    top.set_title("The same recipe, seed and data through every backend (2 workers)")
    top.legend()
    bottom.legend(fontsize="small")
    bottom.set_ylabel(f"|step_loss - {REFERENCE}|")
    bottom.set_xlabel("global step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_plot(uri: str, curves: dict[str, np.ndarray], deviations: dict[str, float], args: argparse.Namespace) -> str:
    """A run `loss-parity`, in the pipelines' experiment, holding the plot, the benchmark's arguments and each
    backend's largest deviation; returns its id."""
    from mlflow.tracking import MlflowClient

    from contract import tracking
    from contract.config import RunSection

    arguments = vars(args)
    run_id = tracking.start_run(uri, RunSection.experiment, "loss-parity", arguments,
                                "".join(f"{key}: {value}\n" for key, value in arguments.items()))
    client = MlflowClient(uri)
    for name, deviation in deviations.items():
        client.log_metric(run_id, f"max_loss_deviation.{name}", deviation)
    with tempfile.TemporaryDirectory() as tmp:
        plot(curves, Path(tmp) / "loss_parity.png")
        client.log_artifact(run_id, str(Path(tmp) / "loss_parity.png"))
    tracking.end_run(uri, run_id)
    return run_id


def main() -> None:
    from contract.tracking import tracking_uri

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps per worker per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--only", default=",".join(BACKENDS), help="comma-separated rows (ddp is always run)")
    parser.add_argument("--dropout", type=float, default=0.0, help="the MLP's dropout (0: off)")
    args = parser.parse_args()
    ensure_mnist()
    uri = tracking_uri()
    names = [REFERENCE, *[n for n in args.only.split(",") if n != REFERENCE]]
    curves = {}
    for name in names:
        history, _ = pipeline_run([*BACKENDS[name], *recipe(args)], tracking_uri=uri)
        curves[name] = np.array(history["step_loss"])
        print(f"{name:15s} {len(curves[name])} steps, first {curves[name][0]:.6f}, last {curves[name][-1]:.6f}",
              flush=True)
    reference = curves[REFERENCE]
    deviations = {}
    for name in names[1:]:
        if len(curves[name]) != len(reference):
            raise RuntimeError(f"{name}: {len(curves[name])} step losses, {REFERENCE} has {len(reference)}")
        deviations[name] = float(np.abs(curves[name] - reference).max())
        relative = float((np.abs(curves[name] - reference) / np.abs(reference)).max())
        print(f"{name:15s} max |diff| {deviations[name]:.3g} (relative {relative:.3g}) against {REFERENCE}")
    run_id = log_plot(uri, curves, deviations, args)
    print(f"plot: MLflow run {run_id} ({uri}), artifact loss_parity.png")
    print(f"max_loss_deviation={max(deviations.values(), default=0.0):.6g}")


if __name__ == "__main__":
    main()
