"""The ``tokcap`` command line: ``demo``, ``train``, ``show``, ``verify``, ``bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RAY_ADDRESS_HELP = (
    "run TransferQueue and the reassembler pool on this existing Ray cluster (host:port of "
    "its GCS, or auto) instead of starting a local one; its nodes need tokcap installed"
)
_Options = TypeVar("_Options", bound="DataclassInstance")

EPILOG = "Run `tokcap demo --quick` to see the whole pipeline on this machine in a few minutes."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tokcap`` CLI; return the process exit status.

    Errors end in one line on stderr, never a traceback (``TOKCAP_TRACEBACK=1`` shows it):
    exit 4 for a file that cannot be read, 3 for data tokcap refuses, 1 otherwise.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "verify":
        from tokcap_core._cli import main as core_main

        return int(core_main(args, prog="tokcap") or 0)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("tokcap: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("TOKCAP_TRACEBACK"):
            raise
        return _one_line_error(args, e)


def _one_line_error(args: list[str], error: Exception) -> int:
    from tokcap_core.errors import TokcapError

    where = f"tokcap {args[0]}" if args else "tokcap"
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        inner = error.exceptions[0]  # a task group's one failure: name it, not the group
        if not isinstance(inner, Exception):
            break
        error = inner
    if isinstance(error, TokcapError):
        print(f"{where}: [{error.code}] {error.message}", file=sys.stderr)
        return 3
    if isinstance(error, OSError):
        print(f"{where}: {error.strerror or error}: {error.filename or ''}", file=sys.stderr)
        return 4
    kind = type(error).__name__
    print(f"{where}: {kind}: {error} (TOKCAP_TRACEBACK=1 shows where)", file=sys.stderr)
    return 1


def _run(args: list[str]) -> int:
    parser = _parser()
    ns = parser.parse_args(args)
    if ns.command == "demo":
        return _demo(ns)
    if ns.command == "train":
        return _train(ns)
    if ns.command == "show":
        return _show(ns.run_dir)
    if ns.command == "bench":
        return _bench(ns.name, ns.args)
    parser.print_help()
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokcap", description=__doc__, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="the whole pipeline on this machine: tiny model, vLLM + gate, TransferQueue, Ray",
        description="Run G groups x N multi-turn agent rollouts through the tokcap gate, "
        "reassemble them on a Ray pool and report (summary.json, report.html).",
    )
    demo.add_argument("--quick", action="store_true", help="small run for CI (2 x 4 x 3 turns)")
    demo.add_argument("--groups", type=_positive, help="groups (default 4; quick 2)")
    demo.add_argument("--rollouts", type=_positive, help="rollouts per group (default 6; quick 4)")
    demo.add_argument(
        "--turns", type=_positive, help="model calls per rollout (default 4; quick 3)"
    )
    demo.add_argument("--max-tokens", type=_positive, help="tokens per call (default 24; quick 16)")
    demo.add_argument(
        "--segments", choices=("terminal", "all"), default="terminal",
        help="terminal: one row per rollout; all: also one row per rewritten-away history",
    )  # fmt: skip
    demo.add_argument("--out", type=Path, help="run folder (default .tokcap/runs/<timestamp>)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--ray-address", help=RAY_ADDRESS_HELP)
    _gate_arguments(demo)
    demo.add_argument(
        "--model-family", choices=("qwen", "mistral", "idefics3"), default="qwen",
        help="qwen: tiny Qwen3, ChatML + hermes tool calls (default); mistral: tiny Mistral "
        "with the real Tekken tokenizer, --tokenizer-mode mistral, mistral tool calls; idefics3: "
        "tiny Idefics3, a picture with each task and one in a tool answer (chat only)",
    )  # fmt: skip
    train = sub.add_parser(
        "train",
        help="a closed GRPO loop on the tiny model through the gate, with weight pushes",
        description="Every step: the harness plays G groups x N chats through the gate, the "
        "trainer closes them, fetches verified receipts, reassembles rows on the Ray pool, "
        "takes a policy-gradient step (checking its logprobs against the engine's) and "
        "pushes the new weights into the running engine (summary.json, report.html).",
    )
    train.add_argument("--steps", type=_positive, default=40, help="training steps (default 40)")
    train.add_argument("--groups", type=_positive, default=4, help="groups per step (default 4)")
    train.add_argument(
        "--rollouts", type=_positive, default=8, help="rollouts per group (default 8)"
    )
    train.add_argument(
        "--task", choices=("agent", "digits", "long-tail"), default="agent",
        help="agent: a tool result from the environment between the model's calls (default); "
        "digits: the user asks for more digits; long-tail: the agent task where 1 rollout in 5 "
        "makes 6-10 calls of 4x --max-tokens and the rest 1-2 (--turns is not used)",
    )  # fmt: skip
    train.add_argument(
        "--harness-api", choices=("chat", "responses", "messages"), default="chat",
        help="the API the harness speaks: chat completions (default), the openai client's "
        "Responses API (previous_response_id chaining) or the anthropic SDK's Messages",
    )  # fmt: skip
    train.add_argument(
        "--turns",
        type=_positive,
        help="model calls per rollout (default 2 for agent, 1 for digits)",
    )
    train.add_argument(
        "--max-tokens", type=_positive, default=16, help="tokens per call (default 16)"
    )
    train.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    train.add_argument("--out", type=Path, help="run folder (default .tokcap/runs/train-<time>)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--ray-address", help=RAY_ADDRESS_HELP)
    _gate_arguments(train)
    train.add_argument(
        "--async", dest="mode", action="store_const", const="async", default="sync",
        help="a rollout pump keeps the engine busy while a train pump collects and trains; "
        "weights pushed in flight (in-flight calls continue on the new weights)",
    )  # fmt: skip
    train.add_argument(
        "--max-staleness", type=_natural, default=2, metavar="K",
        help="--async: train no token sampled more than K versions behind (default 2)",
    )  # fmt: skip
    train.add_argument(
        "--model-family", choices=("qwen", "idefics3"), default="qwen",
        help="qwen: the tiny Qwen3 (default); idefics3: a tiny vision-language model, each "
        "rollout's first message carrying an image whose processed tensors the trainer reads "
        "back from the sink, verified, for its forward pass",
    )  # fmt: skip
    train.add_argument(
        "--no-importance", dest="importance", action="store_const", const=False, default=None,
        help="--async: no decoupled-PPO importance weights (TIS/MIS; on by default)",
    )  # fmt: skip
    show = sub.add_parser(
        "show",
        help="re-print the summary of a saved demo or train run",
        description="Re-print the summary a demo or train run saved (its summary.json).",
    )
    show.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN",
        help="a run folder (.tokcap/runs/...) or its summary.json",
    )
    sub.add_parser(
        "verify",
        help="verify a manifest against staged records (forwards to `tokcap-core verify`)",
        add_help=False,
    )
    bench = sub.add_parser("bench", help="list the benchmarks in bench/, or run one")
    bench.add_argument("name", nargs="?", help="a script in bench/ (with or without .py)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _gate_arguments(command: argparse.ArgumentParser) -> None:
    """``--gates N`` and ``--gate URL`` (demo and train)."""
    command.add_argument(
        "--gates", type=_positive, default=0,
        help="start N gates, each its own `tokcap-vllm serve` process on the run's Ray "
        "(default: one gate in this process)",
    )  # fmt: skip
    command.add_argument(
        "--gate", dest="gate_urls", action="append", default=[], metavar="URL",
        help="a gate someone else started with --tokcap-sink tq on --ray-address's cluster "
        "(repeat; its token in TOKCAP_CONTROL_TOKEN)",
    )  # fmt: skip


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def _natural(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _options(cls: type[_Options], ns: argparse.Namespace) -> _Options:
    """``cls`` from the parsed flags that name its fields (the others keep their defaults)."""
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in vars(ns).items() if name in names})


def _demo(ns: argparse.Namespace) -> int:
    from ._startup import start_up

    start_up()  # before vLLM, torch or Ray is imported
    from .demo import DemoOptions, run_demo

    return run_demo(_options(DemoOptions, ns))


def _train(ns: argparse.Namespace) -> int:
    from ._startup import start_up

    start_up()  # before vLLM, torch or Ray is imported
    from .loop import run_train

    return run_train(vars(ns))


def _show(run_dir: Path) -> int:
    from .demo import print_summary, summary_console
    from .loop import print_train_summary

    path = run_dir / "summary.json" if run_dir.is_dir() else run_dir
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        print(f"tokcap show: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 4
    except ValueError as e:
        print(f"tokcap show: {path} is not JSON ({e}): not a run summary", file=sys.stderr)
        return 3
    console = summary_console()
    # Rendered whole before anything is printed: a file that is not a summary gives one
    # line, not half a table and a traceback.
    try:
        with console.capture() as captured:
            if isinstance(summary, dict) and summary.get("kind") == "train":
                print_train_summary(summary, console)
            else:
                print_summary(summary, console)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        print(
            f"tokcap show: {path} is not a tokcap run summary ({type(e).__name__}: {e}); "
            "pass a run folder or the summary.json a demo or train run saved",
            file=sys.stderr,
        )
        return 3
    sys.stdout.write(captured.get())
    report = path.parent / "report.html"
    if report.exists():
        console.print(f"report: [bold]{report}[/]")
    return 0


def _bench_dir() -> Path | None:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "bench").is_dir():
            return base / "bench"
    return None


def _bench(name: str | None, args: list[str]) -> int:
    folder = _bench_dir()
    if folder is None:
        print(
            "tokcap bench: no bench/ folder here; run it from a tokcap checkout.", file=sys.stderr
        )
        return 2
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if name is None:
        print(f"benchmarks in {folder} (run: tokcap bench NAME [ARGS...]):")
        for script in scripts:
            print(f"  {script.stem:<24} {_first_line(script)}")
        return 0
    script = folder / (name if name.endswith(".py") else f"{name}.py")
    if not script.is_file():
        print(f"tokcap bench: no {script.name} in {folder}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args])


def _first_line(script: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


if __name__ == "__main__":
    raise SystemExit(main())
