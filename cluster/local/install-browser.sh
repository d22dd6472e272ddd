#!/usr/bin/env bash
# Debian's chromium and chromium-driver, for pipelines/sweep/screenshots.py (the MLflow UI in a real browser) and its
# test. Selenium drives them; it downloads nothing. Returns at once when both are installed; needs root otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
source cluster/lib/apt-packages.sh
ensure_apt_packages install-browser chromium chromium-driver
