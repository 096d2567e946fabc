#!/usr/bin/env bash
# Set up a fresh machine for the Fixbook: the project venv (.venv) with torch 2.13.0 (CPU), the
# notebook/doc/test stack and the `fixes` package (editable), then every DeepSpeed release of
# ci/releases.toml side by side (.deepspeed/<release>) with one Jupyter kernel each.
# Idempotent: a second run only checks.
#
#   bash ci/setup.sh              everything: what the tests need
#   bash ci/setup.sh notebooks    what the main job needs (ci/build.sh): the project venv and the release set
#   bash ci/setup.sh matrix       the main job's set and the other environments (ci/build.sh --env all)
set -euo pipefail
cd "$(dirname "$0")/.."
usage() {
  cat <<'USAGE'
usage: bash ci/setup.sh [MODE]
  (no mode)   everything the tests need: the project venv, the DeepSpeed release set and the sweep's
              boundary releases (one Jupyter kernel each), the environments the tests use, Debian's chromium
  notebooks   what the main job needs (bash ci/build.sh): the project venv and the release set; no other
              environment, no sweep boundary releases, no chromium
  matrix      the notebooks' whole matrix (bash ci/build.sh --env all): notebooks and the other environments
It says what it will make, with the time and disk a fresh set-up last took, before it starts. Idempotent.
USAGE
}
SCOPE=${1:-all}
case "$SCOPE" in
  all|notebooks|matrix) ;;
  -h|--help|help) usage; exit 0 ;;
  *) echo "unknown mode: $SCOPE" >&2; usage >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
"$PYTHON" ci/releases/setup_plan.py plan "$SCOPE"
FRESH=0
[ -x .venv/bin/python ] || FRESH=1
STARTED=$SECONDS
LOAD=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")

# Debian packages are installed as root, or with a passwordless sudo where there is one (GitHub's runners).
can_install() { [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; }
apt_get() {
  if [ "$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get "$@"
  else sudo -n env DEBIAN_FRONTEND=noninteractive apt-get "$@"; fi
}
# Debian's Chromium for the site's browser test (Playwright drives it; it downloads no browser).
if [ "$SCOPE" = all ] && ! command -v chromium >/dev/null 2>&1; then
  if can_install; then
    apt_get update -qq && apt_get install -y -qq chromium >/dev/null
  else
    echo "chromium is missing and this is neither root nor a passwordless sudo: sudo apt-get install chromium" >&2
    exit 1
  fi
fi
# Debian's ccache, through which DeepSpeed's JIT ops compile: every release builds its CPU ops on first use, and
# many releases share their sources byte for byte (ci/releases extensions_dir). Without it each build compiles.
if [ ! -x /usr/lib/ccache/c++ ]; then
  if can_install; then
    { apt_get install -y -qq ccache >/dev/null 2>&1 \
      || { apt_get update -qq && apt_get install -y -qq ccache >/dev/null; }; } \
      || echo "ccache could not be installed: DeepSpeed's ops are compiled for each release" >&2
  else
    echo "ccache is missing and this is neither root nor a passwordless sudo: DeepSpeed's ops are compiled for each release (sudo apt-get install ccache)" >&2
  fi
fi
# Debian's numactl: DeepSpeed 0.14.4 - 0.15.x's CPU accelerator runs it to bind each process's cores (without it
# those releases fail with FileNotFoundError: 'numactl'). The sweep measures them and the tests re-check those that
# are boundary releases: required for everything (the default mode); the other modes run newer releases only.
if ! command -v numactl >/dev/null 2>&1; then
  if can_install; then
    apt_get install -y -qq numactl >/dev/null 2>&1 \
      || { apt_get update -qq && apt_get install -y -qq numactl >/dev/null; } \
      || echo "numactl could not be installed: DeepSpeed 0.14.4 - 0.15.x cannot run here" >&2
  fi
  if ! command -v numactl >/dev/null 2>&1; then
    echo "numactl is missing: DeepSpeed 0.14.4 - 0.15.x cannot run here (sudo apt-get install numactl)" >&2
    [ "$SCOPE" != all ] || exit 1
  fi
fi
df -h --output=avail,target . | sed -n '2s/^ */disk before set-up: /p'
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No pip cache: each wheel is installed once per machine, and PyPI's CUDA torch wheels would take GBs twice.
export PIP_NO_CACHE_DIR=1
# pip for the venv: the base Python's own, pointed at the venv (--python), where it has one: a venv made without
# pip takes a tenth of a second, ensurepip 5 s. Otherwise the venv's (ensurepip).
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv --without-pip .venv
  PIP=("$PYTHON" -m pip --python .venv/bin/python)
else
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  PIP=(.venv/bin/python -m pip)
fi
# uv (ci/requirements.txt pins it) installs in parallel and byte-compiles on all cores, where pip does both on one
# (torch alone: 33 s with pip, against the whole list in 24 s with uv, on 2 cores). Every process then reads its
# modules' .pyc, also where PYTHONDONTWRITEBYTECODE is set.
# Which torch this machine's pip would install for the pin (its configuration: a CPU wheel on local disk, a
# constraint, an index), resolved by pip without installing it (while uv is installed: both take one core); uv then
# installs that very file with the rest, so no other torch is ever downloaded.
TORCH_PIN="torch==$(sed -n 's/^torch = "\(.*\)"/\1/p' ci/releases.toml)"
TORCH_REPORT=$(mktemp)
trap 'rm -f "$TORCH_REPORT"' EXIT
"${PIP[@]}" install --quiet --dry-run --no-deps --ignore-installed --report "$TORCH_REPORT" "$TORCH_PIN" >/dev/null &
resolving=$!
"${PIP[@]}" install --quiet "$(grep -m1 '^uv==' ci/requirements.txt)"
wait "$resolving"
TORCH_URL=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"])' \
  "$TORCH_REPORT")
UV_CACHE_DIR=.cache/uv .venv/bin/uv pip install --quiet --compile-bytecode -p .venv/bin/python \
  "torch @ $TORCH_URL" -r ci/requirements.txt
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
.venv/bin/python -m compileall -q -j 0 fixes >/dev/null  # the package every kernel, rank and check imports
# Nothing above may have replaced torch: fail loudly if it did.
.venv/bin/python - <<'PY'
import importlib.metadata, tomllib
want = tomllib.load(open("ci/releases.toml", "rb"))["torch"]
have = importlib.metadata.version("torch")
assert have.split("+")[0] == want, f"torch {have} installed, ci/releases.toml pins {want}"
PY
# The other (Python, torch) environments of ci/environments.toml (Colab's shape: Python 3.12, PyPI torch), for the
# tests and the matrix mode, are mostly downloads, the DeepSpeed releases mostly CPU (each sdist's setup.py): both at
# once. The main job (notebooks) runs in the project venv only.
# The default mode (the tests) builds only the environments the tests use (`tests = true` in ci/environments.toml).
which=()
if [ "$SCOPE" = all ]; then which=(--tests); fi
environments=""
if [ "$SCOPE" != notebooks ]; then
  .venv/bin/python -m ci.releases.environments install "${which[@]}" &
  environments=$!
fi
if [ "$SCOPE" = all ]; then
  .venv/bin/python -m ci.releases install
else
  .venv/bin/python -m ci.releases install --no-boundaries
fi
if [ -n "$environments" ]; then
  if ! wait "$environments"; then
    echo "ci/setup.sh: python -m ci.releases.environments install failed (see above)" >&2
    exit 1
  fi
  # Again, now that every release is installed: each environment's kernels (the environments are ready: seconds).
  .venv/bin/python -m ci.releases.environments install "${which[@]}"
fi
df -h --output=avail,target . | sed -n '2s/^ */disk after set-up: /p'
if [ "$FRESH" = 1 ]; then  # the next plan's figures: this fresh set-up's time and what it made
  "$PYTHON" ci/releases/setup_plan.py record "$SCOPE" $((SECONDS - STARTED)) "$LOAD"
  echo "fresh set-up ($SCOPE) took $(( (SECONDS - STARTED) / 60 )) min $(( (SECONDS - STARTED) % 60 )) s"
fi
