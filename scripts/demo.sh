#!/usr/bin/env bash
# The demo: bash scripts/demo.sh — verify the shipped example manifest against its staged records.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

bash scripts/setup.sh
EXAMPLES=packages/tokcap-core/src/tokcap_core/examples
uv run --locked tokcap-core verify "$EXAMPLES/manifest.json" --staged "$EXAMPLES/staged.json"
