#!/usr/bin/env bash
# Build horovod 0.28.1 (Gloo, no MPI, PyTorch + TensorFlow ops) from the PyPI sdist and install it into .venv.
#
# Why a source build: 0.28.1 is the last release and has no wheel; its CMake files ask for C++14 while torch 2.13
# needs C++17, and its TF XLA op includes a header that moved in TF 2.21. We patch exactly those lines.
# The wheel is cached outside the repo, keyed by every input (sdist hash, Python, torch, TF, the patch and build
# code), so a second setup only reinstalls it; when the keyed build is already installed it returns at once.
# Run after cluster/local/setup-env.sh (tests/run.sh does). Needs root for the apt packages when they are missing.
set -euo pipefail
cd "$(dirname "$0")/../.."

HOROVOD_VERSION=0.28.1
SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
APT_PACKAGES=(cmake g++ make libhighwayhash-dev libfarmhash-dev)
# Build backend for `pip wheel --no-build-isolation` (pip freeze leaves these out of requirements.lock).
BUILD_TOOLS=(setuptools==84.2.1 wheel==0.48.0)
PY=.venv/bin/python
CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/ray-train-pipelines/horovod"

die() { echo "build-horovod: ERROR: $*" >&2; exit 1; }
source cluster/lib/apt-packages.sh
say() { echo "build-horovod: $*"; }

[ -x "$PY" ] || die "missing .venv: run cluster/local/setup-env.sh first"

# The compiled ops link against torch's and TF's C++ ABI, so their versions are part of the cache key.
framework_versions() {
  "$PY" - <<'EOF'
import importlib.metadata as md, sys
print(f"py{sys.version_info[0]}{sys.version_info[1]}-torch{md.version('torch')}-tf{md.version('tensorflow')}")
EOF
}
versions=$(framework_versions) || die "torch and tensorflow must be installed in .venv (run setup-env.sh)"

installed_version() {
  "$PY" -c 'import importlib.metadata as md; print(md.version("horovod"))' 2>/dev/null || true
}

check_python_build_deps() {
  "$PY" -m pip install --quiet "${BUILD_TOOLS[@]}" || die "could not install the build tools ${BUILD_TOOLS[*]}"
  # horovod's runtime deps must already be pinned in requirements.lock: we install the wheel with --no-deps.
  local mod
  for mod in setuptools wheel psutil cloudpickle yaml packaging torch tensorflow; do
    "$PY" -c "import $mod" 2>/dev/null || die "Python package '$mod' is missing from .venv (run setup-env.sh)"
  done
}

fetch_sdist() {  # $1: directory; prints the verified sdist path
  local dir=$1 f="$1/horovod-${HOROVOD_VERSION}.tar.gz"
  if [ ! -f "$f" ]; then
    "$PY" -m pip download --quiet --no-binary :all: --no-deps "horovod==${HOROVOD_VERSION}" -d "$dir" >&2 \
      || die "could not download the horovod ${HOROVOD_VERSION} sdist from PyPI"
  fi
  echo "${SDIST_SHA256}  $f" | sha256sum -c --quiet - >&2 \
    || { rm -f "$f"; die "sha256 of $f does not match the pinned ${SDIST_SHA256}"; }
  echo "$f"
}

replace_line() {  # $1 file, $2 exact line (after leading spaces), $3 replacement; fails if the line is not there
  grep -qxF -- "$2" <(sed 's/^[[:space:]]*//' "$1") || die "patch: line '$2' not found in $1"
  local esc_old esc_new
  esc_old=$(printf '%s' "$2" | sed 's/[]\/$*.^[]/\\&/g')
  esc_new=$(printf '%s' "$3" | sed 's/[\/&]/\\&/g')
  sed -i "s/^\([[:space:]]*\)${esc_old}\$/\1${esc_new}/" "$1"
}

patch_source() {  # $1: unpacked sdist
  local src=$1
  # torch 2.13 headers need C++17; horovod asks for C++14 in these two places.
  replace_line "$src/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
  replace_line "$src/horovod/torch/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
  # The XLA op includes a TF header path that moved in TF 2.21; it is only used with XLA + MPI, which we do not build.
  replace_line "$src/horovod/tensorflow/CMakeLists.txt" \
    'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")' \
    '# xla_mpi_ops.cc dropped by cluster/local/build-horovod.sh (TF 2.21 moved its XLA header)'
}

build_wheel() {  # $1: sdist, $2: output wheel dir, $3: log file
  local work
  work=$(mktemp -d "${CACHE_DIR}/build.XXXXXX")
  tar -xzf "$1" -C "$work"
  patch_source "$work/horovod-${HOROVOD_VERSION}"
  say "building horovod ${HOROVOD_VERSION} (Gloo, PyTorch, TensorFlow; ~5-12 min on 2 cores); log: $3"
  if ! env HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS= HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="${MAKEFLAGS:--j2}" \
      "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$work/dist" \
      "$work/horovod-${HOROVOD_VERSION}" >"$3" 2>&1; then
    echo "----- last lines of $3 -----" >&2
    grep -E "error|Error|not found|No such file|Could NOT find" "$3" | tail -n 15 >&2 || true
    tail -n 20 "$3" >&2
    die "horovod build failed; the lines above name the missing piece (full log: $3)"
  fi
  mkdir -p "$2"
  mv "$work"/dist/horovod-*.whl "$2"/
  rm -rf "$work"
}

# The key covers the recipe as code: `declare -f` prints the patch/build functions without comments, so editing a
# comment keeps the cached wheel while changing a patch or a build flag rebuilds it.
recipe_hash=$(declare -f replace_line patch_source build_wheel | sha256sum | cut -c1-12)
key="${HOROVOD_VERSION}-${SDIST_SHA256:0:12}-${versions}-${recipe_hash}"
stamp=".venv/.horovod-${key}"
if [ -f "$stamp" ] && [ "$(installed_version)" = "$HOROVOD_VERSION" ]; then
  exit 0
fi

mkdir -p "$CACHE_DIR"
wheel_dir="$CACHE_DIR/wheels/$key"
if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  ensure_apt_packages build-horovod "${APT_PACKAGES[@]}" || exit 1
  check_python_build_deps
  sdist=$(fetch_sdist "$CACHE_DIR")
  start=$SECONDS
  build_wheel "$sdist" "$wheel_dir" "$CACHE_DIR/build-${key}.log"
  say "built in $((SECONDS - start)) s: $(ls "$wheel_dir")"
else
  say "using cached wheel $(ls "$wheel_dir"/horovod-*.whl)"
fi

"$PY" -m pip install --quiet --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl \
  || die "could not install $(ls "$wheel_dir"/horovod-*.whl) into .venv"
# Import the compiled ops of both frameworks so a broken wheel fails here, not inside a Ray worker. TF's start-up
# chatter goes to stderr even at TF_CPP_MIN_LOG_LEVEL=3, so the output is shown only on failure.
if ! check=$("$PY" -c 'import horovod.torch.mpi_lib_v2, horovod.tensorflow.mpi_ops' 2>&1); then
  echo "$check" | tail -n 20 >&2
  die "horovod installed but its torch/tensorflow ops do not load (traceback above)"
fi
rm -f .venv/.horovod-*
touch "$stamp"
say "horovod ${HOROVOD_VERSION} installed"
