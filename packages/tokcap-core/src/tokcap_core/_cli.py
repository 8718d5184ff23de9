"""The ``tokcap-core`` command line: verify a manifest (and staged rows), re-check golden vectors.

Exit codes: 0 verified; 1 the rollout is poisoned (the manifest itself is sound);
2 usage error; 3 verification failed (tampered, malformed or inconsistent data);
4 a file could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ._errors import TokcapError
from ._golden import assert_golden_vectors
from ._manifest import decode_manifest, verify_manifest
from ._receipt import SEGMENT_MODES, assemble_receipt
from ._staged_json import decode_staged_calls
from ._verify import verify_staged

__all__ = [
    "EXIT_IO_ERROR",
    "EXIT_OK",
    "EXIT_POISONED",
    "EXIT_USAGE",
    "EXIT_VERIFICATION_FAILED",
    "main",
]

EXIT_OK: Final = 0
EXIT_POISONED: Final = 1
EXIT_USAGE: Final = 2
EXIT_VERIFICATION_FAILED: Final = 3
EXIT_IO_ERROR: Final = 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokcap-core", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify", help="replay a manifest, print its receipt, check staged rows"
    )
    verify.add_argument("manifest", type=Path, help="manifest JSON, as the control plane serves it")
    verify.add_argument(
        "--staged", type=Path, help="staged-calls JSON to verify against the receipt"
    )
    verify.add_argument("--segments", choices=SEGMENT_MODES, default="terminal")
    verify.add_argument(
        "--expected-head", metavar="SEQ:HASH", help="the head kept when the rollout closed"
    )
    sub.add_parser("golden", help="recompute the shipped golden vectors")
    return parser


def _head(text: str) -> tuple[int, str]:
    seq, _, digest = text.partition(":")
    if not seq.isdigit() or len(digest) != 64:
        raise SystemExit(f"tokcap-core: --expected-head must be SEQ:HASH, got {text!r}")
    return int(seq), digest


def _verify(args: argparse.Namespace) -> int:
    try:
        manifest_bytes = args.manifest.read_bytes()
        staged_bytes = args.staged.read_bytes() if args.staged else None
    except OSError as e:
        print(f"tokcap-core: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_IO_ERROR
    expected = _head(args.expected_head) if args.expected_head else None
    try:
        state = verify_manifest(decode_manifest(manifest_bytes), expected_head=expected)
        receipt = assemble_receipt(state, segments=args.segments)
        report = {"receipt": receipt.to_json()}
        if staged_bytes is not None and receipt.ok:
            segments = verify_staged(receipt, decode_staged_calls(staged_bytes))
            report["staged"] = {
                "segments": len(segments),
                "calls_verified": sum(len(s) for s in segments),
                "tokens": sum(len(c.tokens) for s in segments for c in s),
            }
    except TokcapError as e:
        print(json.dumps({"error": {"code": e.code, "message": e.message}}, indent=2))
        return EXIT_VERIFICATION_FAILED
    print(json.dumps(report, indent=2))
    return EXIT_OK if receipt.ok else EXIT_POISONED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see module docstring)."""
    args = _parser().parse_args(argv)
    if args.command == "verify":
        return _verify(args)
    try:
        count = assert_golden_vectors()
    except TokcapError as e:
        print(f"golden vectors FAILED: [{e.code}] {e.message}")
        return EXIT_VERIFICATION_FAILED
    print(f"golden vectors OK: {count} values recomputed")
    return EXIT_OK
