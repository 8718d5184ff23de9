"""The ``tokcap-core`` command line: verify a capture, re-check the golden vectors.

Output convention, for every command and every outcome: one JSON document on stdout (the
result, or ``{"error": {"code", "message", "hint"?}}``), one human line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, Final, NoReturn

from ._cli_verify import (
    EXIT_IO_ERROR,
    EXIT_OK,
    EXIT_POISONED,
    EXIT_USAGE,
    EXIT_VERIFICATION_FAILED,
    FORMATS,
    Outcome,
    verify_command,
)
from ._errors import TokcapError
from ._receipt import SEGMENT_MODES
from .golden import assert_golden_vectors

__all__ = [
    "EXIT_IO_ERROR",
    "EXIT_OK",
    "EXIT_POISONED",
    "EXIT_USAGE",
    "EXIT_VERIFICATION_FAILED",
    "main",
]

EXIT_CODES: Final = f"""\
exit codes:
  {EXIT_OK}  verified (with --strict: and nothing staged or recorded left uncovered)
  {EXIT_POISONED}  the rollout is poisoned (the capture itself is sound; nothing to train)
  {EXIT_USAGE}  usage error
  {EXIT_VERIFICATION_FAILED}  verification failed: tampered, malformed, inconsistent or too large
     (with --strict: also anything staged or recorded that no verified segment covers)
  {EXIT_IO_ERROR}  a file could not be read

stdout always carries one JSON document (the result, or {{"error": {{"code", ...}}}});
stderr carries one human-readable line.
"""

VERIFY_DESCRIPTION: Final = """\
Replay a manifest, assemble its receipt, and check the staged calls against it.

FILE is tokcap's manifest by default; --format gym reads a NeMo-Gym RolloutReceipt and its
staged records (--staged, a JSON array or JSON Lines in manifest order) with Gym's rules;
--format gym-record checks one Gym staged record alone (schema and recomputed digest).
Either FILE or --staged may be "-" (standard input). Calls the ledger recorded, or the
staged file holds, that no verified segment covers are listed under "uncovered" (id and
why); a staged call that contradicts the ledger's digest always fails, and --strict fails
on any uncovered call that holds tokens (a call that failed before it was served holds
none: it is reported only). Fields no digest binds are listed under "unbound".
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors in the CLI's output convention (exit 2)."""

    def error(self, message: str) -> NoReturn:
        _emit({"error": {"code": "usage", "message": message}}, f"{self.prog}: error: {message}")
        self.exit(EXIT_USAGE)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Verify tokcap (and NeMo-Gym) captures; re-check the golden vectors.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    verify = sub.add_parser(
        "verify",
        help="replay a manifest, print its receipt, check staged rows",
        description=VERIFY_DESCRIPTION,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument(
        "manifest",
        metavar="FILE",
        help="tokcap: the manifest JSON; gym: the RolloutReceipt JSON; gym-record: one "
        'record; "-": stdin',
    )
    verify.add_argument(
        "--format", choices=FORMATS, default="tokcap", help="what FILE is (default: tokcap)"
    )
    verify.add_argument(
        "--staged",
        metavar="STAGED",
        help="tokcap: staged-calls JSON; gym: staged records (JSON array or JSONL, manifest "
        'order); "-": stdin',
    )
    verify.add_argument(
        "--segments",
        choices=SEGMENT_MODES,
        help="tokcap: verify the terminal's chain only, or also one chain per other root "
        "(default: all, what the conformance kit checks)",
    )
    verify.add_argument(
        "--expected-head",
        metavar="SEQ:HASH",
        help="tokcap: the ledger head kept when the rollout closed (pins the whole chain)",
    )
    verify.add_argument(
        "--max-staleness",
        metavar="K",
        type=int,
        help="tokcap: fail (exit 3, stale_tokens) when a generated token the receipt names was "
        "sampled more than K versions behind --trained-version (from the ledger's spans alone)",
    )
    verify.add_argument(
        "--trained-version",
        metavar="V",
        type=int,
        help="tokcap: the weight version the batch is trained at (with --max-staleness)",
    )
    verify.add_argument(
        "--batch-manifest",
        metavar="FILE",
        action="append",
        default=[],
        help="tokcap: another manifest of the same batch, checked against the staleness bound "
        "too (repeat for each)",
    )
    verify.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 3) when anything staged or recorded is left uncovered",
    )
    sub.add_parser(
        "golden",
        help="recompute the shipped golden vectors",
        description="Recompute every golden vector shipped with tokcap-core.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _emit(report: dict[str, Any], human: str) -> None:
    print(json.dumps(report, indent=2))
    print(human, file=sys.stderr)


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.format == "gym" and args.staged is None:
        parser.error("--format gym needs --staged SNAPSHOTS.json")
    if args.format == "gym-record" and args.staged is not None:
        parser.error("--format gym-record checks one record alone: no --staged")
    if args.format != "tokcap" and (args.segments or args.expected_head):
        parser.error("--segments and --expected-head apply to the tokcap format only")
    if (args.max_staleness is None) != (args.trained_version is None):
        parser.error("--max-staleness and --trained-version go together")
    if args.max_staleness is not None and (args.max_staleness < 0 or args.trained_version < 0):
        parser.error("--max-staleness and --trained-version are >= 0")
    if args.batch_manifest and args.max_staleness is None:
        parser.error("--batch-manifest needs --max-staleness and --trained-version")
    if args.format != "tokcap" and args.max_staleness is not None:
        parser.error("--max-staleness applies to the tokcap format only")
    if args.manifest == "-" and args.staged == "-":
        parser.error("only one of FILE and --staged can be read from stdin")
    if args.expected_head is not None:
        seq, _, digest = args.expected_head.partition(":")
        hexdigits = all(c in "0123456789abcdef" for c in digest)
        if not seq.isdigit() or len(digest) != 64 or not hexdigits:
            parser.error(
                f"--expected-head must be SEQ:HASH (64 hex digits), got {args.expected_head!r}"
            )


def main(argv: Sequence[str] | None = None, *, prog: str = "tokcap-core") -> int:
    """Run the CLI; returns the exit code (listed in ``--help``)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.command == "verify":
        _check_usage(parser, args)
        outcome: Outcome = verify_command(args)
        _emit(outcome.report, f"{prog} verify: {outcome.human}")
        return outcome.code
    try:
        count = assert_golden_vectors()
    except TokcapError as e:
        _emit(
            {"error": {"code": e.code, "message": e.message}},
            f"{prog} golden: golden vectors FAILED: [{e.code}] {e.message}",
        )
        return EXIT_VERIFICATION_FAILED
    _emit(
        {"golden": {"ok": True, "values": count}},
        f"{prog} golden: golden vectors OK: {count} values recomputed",
    )
    return EXIT_OK
