"""The workspace installs, and ``import tokcap_core`` stays free of heavy or adapter imports."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = (
    "torch",
    "numpy",
    "msgspec",
    "attrs",
    "ray",
    "vllm",
    "transfer_queue",
    "tokcap_tq",
    "tokcap_vllm",
    "tokcap_ray",
    "tokcap_trl",
    "trl",
)


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_import_tokcap_core_imports_no_heavy_or_adapter_module() -> None:
    loaded = _modules_after("import tokcap_core")
    assert "tokcap_core" in loaded
    leaked = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert leaked == []
