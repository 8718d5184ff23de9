#!/usr/bin/env bash
# The demo: bash scripts/demo.sh [tokcap demo options, e.g. --quick]
# The whole pipeline on this machine: a tiny model on vLLM (CPU) behind the tokcap gate, a
# black-box agent harness, TransferQueue and a Ray reassembler pool on a loopback-only local
# Ray; prints a summary and saves summary.json and report.html under .tokcap/runs/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
        # Help needs no set-up: the tokcap CLI's parser is stdlib only.
        echo "bash scripts/demo.sh [OPTIONS]: set up (scripts/setup.sh), then run \`tokcap demo OPTIONS\`."
        echo
        PYTHONPATH=src exec python3 -m tokcap demo --help
    fi
done

bash scripts/setup.sh
exec uv run --locked tokcap demo "$@"
