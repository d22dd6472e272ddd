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
{"excludes": ["/.venv", "/.git", "/data", "/outputs", "/mlflow.db", "/mlartifacts"],
 "env_vars": {"MLFLOW_TRACKING_URI": "$MLFLOW_TRACKING_URI", "PIPELINE_GIT_COMMIT": "$PIPELINE_GIT_COMMIT",
              "OMP_NUM_THREADS": "1"}}
JSON
)
status=0
ray job submit --address "$RAY_DASHBOARD_ADDRESS" --working-dir . --runtime-env-json "$runtime_env" -- \
  rtp train data.path="$root/data/mnist/parquet" run.storage_path="$root/outputs/ray" "$@" \
  2>&1 | tee "$log" || status=$?

run_id=$(grep -o 'mlflow_run_id=[0-9a-f]*' "$log" | tail -n 1 | cut -d= -f2)
echo
echo "MLflow run: ${run_id:-none (see $log)}   store: $MLFLOW_TRACKING_URI"
echo "Look at it: $root/.venv/bin/mlflow ui --backend-store-uri $MLFLOW_TRACKING_URI --port 5000  (then open http://127.0.0.1:5000)"
exit $status
