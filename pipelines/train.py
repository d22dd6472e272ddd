"""Train one model: `python -m pipelines.train [trainer=ddp] [data=mnist] [model=mlp] [key=value ...]`.

What `ray job submit` runs. Uses the cluster at RAY_ADDRESS when set, else starts a local Ray.
Last stdout line: `mlflow_run_id=<id>`. Exit codes: 0 finished, 1 training failed (the MLflow run is
marked FAILED with the error), 2 bad config, data or tracking server (nothing was started).
"""
from __future__ import annotations

import os
import sys
import traceback

from omegaconf import DictConfig, OmegaConf

from pipelines import tracking
from pipelines.config import ConfigError, flatten, load_config
from pipelines.data.idx import DataError
from pipelines.data.shards import read_manifest, shard_paths


def validate(argv: list[str]) -> tuple[DictConfig, dict, str]:
    """Everything that can be checked before taking cluster resources."""
    cfg = load_config(argv)
    manifest = read_manifest(cfg.data.path)  # every shard present, readable and of the manifest's size
    for split in ("train", cfg.data.eval_split):
        shard_paths(cfg.data.path, manifest, split)
    uri = tracking.tracking_uri()
    tracking.check_reachable(uri)
    return cfg, manifest, uri


def init_ray(cfg: DictConfig) -> None:
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    # Never attach to some other cluster on this machine by accident: start our own.
    needed = cfg.trainer.num_workers * cfg.trainer.threads_per_worker + 2  # +2: Ray Data readers
    # The dashboard hosts the State API that Ray Train's placement-group cleaner polls; keep it on.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), dashboard_host="127.0.0.1")


def run_training(cfg: DictConfig, manifest: dict, uri: str, run_id: str) -> None:
    import ray

    from pipelines.data.readers import model_inputs, parquet_datasets
    from trainers import get_backend

    init_ray(cfg)
    try:
        resources = ray.cluster_resources()
        tracking.log_params(uri, run_id, {"cluster.cpus": resources.get("CPU", 0),
                                          "cluster.gpus": resources.get("GPU", 0),
                                          "cluster.nodes": len(ray.nodes())})
        backend = get_backend(cfg.trainer.backend)
        datasets = parquet_datasets(cfg.data.path, {"train": "train", "eval": cfg.data.eval_split})
        inputs = model_inputs(manifest)
        result = backend.build_trainer(cfg, datasets, run_id, uri, inputs).fit()
        if result.checkpoint is None:
            raise RuntimeError("training ended without a checkpoint")
        backend.log_final_model(uri, run_id, cfg, result.checkpoint, inputs)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, manifest, uri = validate(argv)
    except (ConfigError, DataError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    parallel = {"world_size": cfg.trainer.num_workers, "dp": cfg.trainer.dp, "tp": cfg.trainer.tp,
                "backend": cfg.trainer.backend}
    run_name = cfg.run.name or f"{cfg.trainer.backend}-{cfg.data.name}-{cfg.model.name}"
    run_id = tracking.start_run(uri, cfg.run.experiment, run_name, {**flatten(cfg), **parallel},
                                OmegaConf.to_yaml(cfg))
    tracking.log_data_files(uri, run_id, cfg.data.path, manifest)
    print(f"MLflow run {run_id} ({uri})", flush=True)
    try:
        run_training(cfg, manifest, uri, run_id)
    except BaseException as err:  # KeyboardInterrupt too: the run must not stay RUNNING
        tracking.end_run(uri, run_id, error=f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}")
        print(f"error: training failed: {type(err).__name__}: {err}", file=sys.stderr)
        print(f"mlflow_run_id={run_id}", flush=True)
        return 1
    tracking.end_run(uri, run_id)
    print(f"mlflow_run_id={run_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
