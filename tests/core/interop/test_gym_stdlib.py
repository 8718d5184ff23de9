"""The Gym interop is stdlib only: importing it loads nothing outside the standard library."""

from __future__ import annotations

import json
import subprocess
import sys


def _top_level_modules(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return {name.split(".")[0] for name in json.loads(done.stdout.splitlines()[-1])}


def test_importing_the_gym_interop_and_the_cli_loads_only_the_standard_library() -> None:
    # what the interpreter loads by itself (site hooks such as setuptools' .pth) is not ours
    baseline = _top_level_modules("pass")
    loaded = _top_level_modules("import tokcap_core, tokcap_core.interop.gym, tokcap_core._cli")
    added = loaded - baseline - {"tokcap_core"}
    assert sorted(added - set(sys.stdlib_module_names)) == []
