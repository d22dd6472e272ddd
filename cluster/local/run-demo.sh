#!/usr/bin/env bash
# The main job on the embedded default, from nothing: set up .venv, prepare the vendored MNIST into
# Parquet shards, start a local Ray head, `ray job submit` a 2-worker DDP training run logged to MLflow,
# print where to look, stop the head. Extra arguments are config overrides, e.g. `model=cnn trainer.epochs=5`.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

bash cluster/local/setup-env.sh
export PATH="$root/.venv/bin:$PATH" OMP_NUM_THREADS=1
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$root/mlflow.db}
export PIPELINE_GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)

rtp prepare mnist --out data/mnist/parquet

state=outputs/local-cluster
bash cluster/local/ray-local.sh start "$state"
trap 'bash cluster/local/ray-local.sh stop "$state"' EXIT
source "$state/ray.env"

log=outputs/demo-job.log
runtime_env=$(cat <<JSON
{"excludes": ["/.venv", "/.git", "/data", "/outputs", "/mlflow.db", "/mlartifacts", "/.ruff_cache", "/.pytest_cache"],
 "env_vars": {"MLFLOW_TRACKING_URI": "$MLFLOW_TRACKING_URI", "PIPELINE_GIT_COMMIT": "$PIPELINE_GIT_COMMIT",
              "OMP_NUM_THREADS": "1"}}
JSON
)
# Submitted without waiting (the submission's own packaging lines go to a file), then the job's output followed:
# what a user reads is the run's, not the job client's.
job=demo-$(date +%Y%m%d-%H%M%S)-$$
ray job submit --address "$RAY_DASHBOARD_ADDRESS" --submission-id "$job" --no-wait --working-dir . \
  --runtime-env-json "$runtime_env" -- \
  rtp train data.path="$root/data/mnist/parquet" run.storage_path="$root/outputs/ray" "$@" \
  > outputs/demo-submit.log 2>&1 || { cat outputs/demo-submit.log; exit 1; }
echo "Ray job $job submitted (its output: ray job logs $job)"
status=0
python cluster/local/follow-job.py "$RAY_DASHBOARD_ADDRESS" "$job" 2>&1 | tee "$log" || status=$?
exit $status
