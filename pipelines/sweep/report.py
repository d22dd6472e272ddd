"""The scaling report of a sweep, computed from its child MLflow runs (the record of what each trial did).

Definitions (also printed under the table):
- throughput: `samples_per_s` (global, each sample once even under TP), mean over the epochs after the first
  (the first one includes start-up and caching), or the only epoch; `tokens_per_s` likewise for text;
  `samples_per_s_per_worker`: throughput / workers (what a layout makes of each worker it takes);
- speedup: throughput / throughput of the 1-worker trial of the same backend and per-worker batch size;
  efficiency: speedup / workers (1.0 = linear scaling);
- time to target: summed training time (`epoch_time_s`) of the epochs up to the first whose `test_accuracy`
  reaches the target;
- peak memory per worker: the largest worker's peak (RSS on CPU, CUDA allocations on GPU) over the run.

`python -m pipelines.sweep.report <parent_run_id> [--out DIR]` rebuilds it for any sweep.
"""
from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from contract.tracking import epoch_values

HISTORY_METRICS = ("train_loss", "test_accuracy", "test_mse", "samples_per_s", "tokens_per_s", "epoch_time_s",
                   "peak_memory_bytes", "tflops_per_rank", "mfu")
COLUMNS = ("trial", "backend", "workers", "tp", "dp", "batch_size", "lr", "status", "epochs", "samples_per_s",
           "samples_per_s_per_worker", "tokens_per_s", "speedup", "efficiency", "tflops_per_rank", "mfu",
           "time_to_target_s", "peak_memory_mib", "test_accuracy", "test_mse", "train_loss", "run_id")
NUMERIC = ("samples_per_s", "samples_per_s_per_worker", "tokens_per_s", "speedup", "efficiency", "tflops_per_rank",
           "mfu", "time_to_target_s", "peak_memory_mib", "test_accuracy", "test_mse", "train_loss")
EVALUATED = ("test_accuracy", "test_mse")  # a task's evaluation metric: a column only where a trial logged it
# Columns only where a trial logged them: the evaluation metrics, and the FLOP figures (a model with a FLOP count;
# `mfu` on a device of known peak: contract/mfu.py).
OPTIONAL = (*EVALUATED, "tflops_per_rank", "mfu")


@dataclass
class TrialRecord:
    """One trial as its child run recorded it."""
    run_id: str
    name: str
    backend: str
    workers: int
    tp: int
    dp: int
    batch_size: int
    lr: float
    status: str
    history: dict[str, list[float]] = field(default_factory=dict)  # metric -> value per epoch, in order


@dataclass
class Report:
    rows: list[dict[str, Any]]
    best: Optional[dict[str, Any]]
    markdown: str
    files: dict[str, Path]


def steady(values: list[float] | None) -> float | None:
    """Mean over the epochs after the first (or the only epoch)."""
    if not values:
        return None
    later = values[1:] or values
    return sum(later) / len(later)


def time_to_target(accuracy: list[float], epoch_times: list[float], target: float) -> float | None:
    for epoch, value in enumerate(accuracy):
        if value >= target:
            return sum(epoch_times[:epoch + 1])
    return None


def summarise(trial: TrialRecord, target_accuracy: float) -> dict[str, Any]:
    """A report row (speedup and efficiency come from `add_scaling`)."""
    h = trial.history
    peak = h.get("peak_memory_bytes")
    throughput = steady(h.get("samples_per_s"))
    return {"trial": trial.name, "backend": trial.backend, "workers": trial.workers, "tp": trial.tp,
            "dp": trial.dp, "batch_size": trial.batch_size, "lr": trial.lr, "status": trial.status,
            "epochs": len(h.get("train_loss", [])), "samples_per_s": throughput,
            "samples_per_s_per_worker": throughput / trial.workers if throughput is not None else None,
            "tokens_per_s": steady(h.get("tokens_per_s")), "speedup": None, "efficiency": None,
            "tflops_per_rank": steady(h.get("tflops_per_rank")), "mfu": steady(h.get("mfu")),
            "time_to_target_s": time_to_target(h.get("test_accuracy", []), h.get("epoch_time_s", []),
                                               target_accuracy),
            "peak_memory_mib": max(peak) / 2**20 if peak else None,
            "test_accuracy": h["test_accuracy"][-1] if h.get("test_accuracy") else None,
            "test_mse": h["test_mse"][-1] if h.get("test_mse") else None,
            "train_loss": h["train_loss"][-1] if h.get("train_loss") else None, "run_id": trial.run_id}


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """Speedup and efficiency against the 1-worker row of the same backend and per-worker batch size."""
    for row in rows:
        baseline = next((b for b in rows if b["backend"] == row["backend"] and b["workers"] == 1
                         and b["batch_size"] == row["batch_size"] and b["samples_per_s"]), None)
        if baseline is None or row["samples_per_s"] is None:
            continue
        row["speedup"] = row["samples_per_s"] / baseline["samples_per_s"]
        row["efficiency"] = row["speedup"] / row["workers"]


def best_row(rows: list[dict[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    """The row with the highest (mode=max) or lowest (min) value of `metric`; rows without it are skipped."""
    candidates = [r for r in rows if r.get(metric) is not None and not math.isnan(r[metric])]
    if not candidates:
        return None
    pick = max if mode == "max" else min
    return pick(candidates, key=lambda r: r[metric])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def shown_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The report's columns: every one, but an optional one no trial logged (a classifier's sweep has no
    test_mse, a sweep on CPUs no mfu)."""
    return [c for c in COLUMNS if c not in OPTIONAL or any(row.get(c) is not None for row in rows)]


def to_markdown(rows: list[dict[str, Any]], best: dict | None, metric: str, mode: str, target: float) -> str:
    columns = [c for c in shown_columns(rows) if c != "run_id"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    best_line = (f"Best by {metric} ({mode}): **{best['trial']}** = {_cell(best[metric])} (run {best['run_id']})"
                 if best else f"Best by {metric} ({mode}): none (no trial reported it)")
    notes = ("throughput = mean `samples_per_s` over epochs after the first; speedup and efficiency against the "
             "1-worker trial of the same backend and batch size; time_to_target_s = training time until "
             f"test_accuracy >= {target}; peak_memory_mib = the largest worker's peak; tflops_per_rank and mfu "
             "(model FLOPs utilisation, where the device's peak is known): means over epochs after the first.")
    return "\n".join(["## Scaling report", "", *lines, "", best_line, "", notes, ""])


def to_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        columns = shown_columns(rows)
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row[k] is None else row[k] for k in columns})


def _by_backend(rows: list[dict[str, Any]], value: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["workers"], r["tp"])):
        if row[value] is not None:
            out.setdefault(row["backend"], []).append(row)
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    return plt


def plot_vs_degree(rows: list[dict[str, Any]], value: str, ylabel: str, path: Path, ideal: float | None = None) -> None:
    """`value` against the number of workers, one line per backend, each point labelled with its tp x dp."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for backend, points in _by_backend(rows, value).items():
        xs, ys = [p["workers"] for p in points], [p[value] for p in points]
        ax.plot(xs, ys, marker="o", label=backend)
        for point in points:
            ax.annotate(f"tp{point['tp']}xdp{point['dp']}", (point["workers"], point[value]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    if ideal is not None:
        ax.axhline(ideal, color="grey", linestyle="--", linewidth=1, label="linear scaling")
    ax.set_xlabel("workers (tp x dp)")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_losses(trials: list[TrialRecord], path: Path) -> None:
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for trial in trials:
        losses = trial.history.get("train_loss", [])
        ax.plot(range(1, len(losses) + 1), losses, marker=".", label=trial.name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("train_loss")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_report(trials: list[TrialRecord], out_dir: Path, target: float, metric: str, mode: str) -> Report:
    """Rows, best row, Markdown, and the files (CSV, Markdown, three PNG plots) written to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [summarise(t, target) for t in trials]
    add_scaling(rows)
    best = best_row(rows, metric, mode)
    markdown = to_markdown(rows, best, metric, mode, target)
    files = {"markdown": out_dir / "scaling_report.md", "csv": out_dir / "scaling_report.csv",
             "throughput": out_dir / "throughput_vs_workers.png",
             "efficiency": out_dir / "efficiency_vs_workers.png", "losses": out_dir / "loss_curves.png"}
    files["markdown"].write_text(markdown)
    to_csv(rows, files["csv"])
    plot_vs_degree(rows, "samples_per_s", "throughput (samples/s)", files["throughput"])
    plot_vs_degree(rows, "efficiency", "scaling efficiency", files["efficiency"], ideal=1.0)
    plot_losses(trials, files["losses"])
    return Report(rows, best, markdown, files)


def read_trials(uri: str, parent_run_id: str) -> list[TrialRecord]:
    """The sweep's child runs (tag `mlflow.parentRunId`) with their per-epoch histories, in trial order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=10000)
    records = []
    for run in sorted(runs, key=lambda r: int(r.data.tags.get("sweep.trial_index", 0))):
        p = run.data.params
        history = {}
        for name in HISTORY_METRICS:
            points = client.get_metric_history(run.info.run_id, name)
            if points:
                history[name] = epoch_values(points)
        records.append(TrialRecord(run.info.run_id, run.info.run_name, p["backend"], int(p["world_size"]),
                                   int(p["tp"]), int(p["dp"]), int(p["trainer.batch_size"]),
                                   float(p["trainer.lr"]), run.info.status, history))
    return records


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    from contract.tracking import run_exists, tracking_uri

    parser = argparse.ArgumentParser(prog="rtp report", description="Rebuild the scaling report of a sweep from its "
                                                                    "MLflow runs")
    parser.add_argument("parent_run_id")
    parser.add_argument("--out", type=Path, default=None, help="folder for the files (default: a temp dir)")
    parser.add_argument("--target-accuracy", type=float, default=0.8)
    parser.add_argument("--metric", default="test_accuracy")
    parser.add_argument("--mode", default="max", choices=("min", "max"))
    args = parser.parse_args(argv)
    uri = tracking_uri()
    if not run_exists(uri, args.parent_run_id):
        print(f"error: parent_run_id: {uri} holds no MLflow run {args.parent_run_id} (a sweep's run id: its "
              f"`mlflow_parent_run_id=` line)", file=sys.stderr)
        return 2
    trials = read_trials(uri, args.parent_run_id)
    if not trials:
        print(f"error: parent_run_id: MLflow run {args.parent_run_id} has no trial runs under it: not a sweep's run",
              file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="scaling-report-"))
    report = build_report(trials, out, args.target_accuracy, args.metric, args.mode)
    print(report.markdown)
    print(f"files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
