"""The gate's stateful model test, long: many more programs and steps than CI runs.

Runs tests/vllm/test_gate_model.py (hypothesis `RuleBasedStateMachine` against the real
server: admits, streams, duplicated request ids, concurrent retries under one key,
disconnects, terminals, closes, releases and reuse, bad bodies) with a long profile.
Usage: python bench/soak_gate_model.py [--examples 50] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    env = {
        **os.environ,
        "TOKCAP_GATE_MODEL_EXAMPLES": str(args.examples),
        "TOKCAP_GATE_MODEL_STEPS": str(args.steps),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    root = Path(__file__).resolve().parents[1]
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/vllm/test_gate_model.py", "--durations=1",
    ]  # fmt: skip
    return subprocess.call(command, cwd=root, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
