"""The format kit, pointed at a verifier's command line (``tokcap-core verify`` or another).

`cli_verifier` turns a command into the ``verify=`` callable `check_capture_format` takes:
each sample is written to two files and verified by the command with its default options,
so the kit holds the CLI's *default* to the same rules as the library's verifier.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._errors import VerificationError

__all__ = ["cli_verifier"]


def cli_verifier(
    command: Sequence[str] | None = None, *, extra: Sequence[str] = ()
) -> Callable[[bytes, bytes], object]:
    """A ``verify`` for `check_capture_format` that runs a verifier command line.

    ``command`` (e.g. ``["tokcap-core", "verify"]``) is run as ``command MANIFEST --staged
    STAGED *extra``; None runs tokcap-core's own ``main`` in this process (the code the
    console script runs, without a process per sample). Exit 0 or 1 returns the JSON
    report; exit 3 raises `VerificationError` with the report's error code; any other exit
    status, or stdout that is not one JSON document, fails with AssertionError.
    """

    def verify(manifest: bytes, staged: bytes) -> object:
        with tempfile.TemporaryDirectory(prefix="tokcap-kit-") as tmp:
            paths = Path(tmp, "manifest.json"), Path(tmp, "staged.json")
            paths[0].write_bytes(manifest)
            paths[1].write_bytes(staged)
            args = [str(paths[0]), "--staged", str(paths[1]), *extra]
            code, out = _run(command, args)
        try:
            report: dict[str, Any] = json.loads(out)
        except ValueError:
            raise AssertionError(f"exit {code}: stdout is not one JSON document: {out!r}") from None
        if code == 3:
            raise VerificationError(report["error"]["code"], report["error"]["message"])
        assert code in (0, 1), f"exit {code}: {report}"
        return report

    return verify


def _run(command: Sequence[str] | None, args: list[str]) -> tuple[int, str]:
    if command is None:
        from ._cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["verify", *args])
        return code, out.getvalue()
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=120, check=False
    )
    return done.returncode, done.stdout
