#!/usr/bin/env bash
# Set everything up and run the whole test suite (slow tests included). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cluster/local/setup-env.sh
# The horovod tests need horovod 0.28.1 built from source (first run ~10 min on 2 cores, then cached).
bash cluster/local/build-horovod.sh
# The MLflow UI test drives Debian's chromium (installed once, as root).
bash cluster/local/install-browser.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
export RAY_DATA_DISABLE_PROGRESS_BARS=1 TF_CPP_MIN_LOG_LEVEL=2
unset RAY_ADDRESS MLFLOW_TRACKING_URI
# Compile the repository's modules once (0.4 s): every process of the suite (pytest, the pipelines' drivers, Ray
# workers, the ranks the parallel tests spawn) then reads them. Where PYTHONDONTWRITEBYTECODE is set (as in this
# project's sandboxes), each process would otherwise compile them again.
python -m compileall -q contract pipelines trainers tests benchmarks cluster > /dev/null
exec python -m pytest tests --durations=20 "$@"
