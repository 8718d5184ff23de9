"""The ``tokcap-core`` command line: verify a manifest (and staged rows), re-check golden vectors.

``verify`` reads tokcap's own manifest by default; ``--format gym`` reads a NeMo-Gym
``RolloutReceipt`` and its staged records (``--staged``, a JSON array or JSON Lines in
manifest order) and verifies them with Gym's rules; ``--format gym-record`` checks one
Gym staged record alone (schema and recomputed digest).

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
from typing import Any, Final

from ._errors import TokcapError
from ._manifest import decode_manifest, verify_manifest
from ._receipt import SEGMENT_MODES, assemble_receipt
from ._rows import TrainingRow
from ._staged_json import decode_staged_calls
from ._verify import verify_staged
from .golden import assert_golden_vectors
from .routes import encode_routes

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
FORMATS: Final = ("tokcap", "gym", "gym-record")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokcap-core", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify", help="replay a manifest, print its receipt, check staged rows"
    )
    verify.add_argument(
        "manifest",
        type=Path,
        metavar="FILE",
        help="tokcap: the manifest JSON; gym: the RolloutReceipt JSON; gym-record: one record",
    )
    verify.add_argument(
        "--format", choices=FORMATS, default="tokcap", help="what FILE is (default: tokcap)"
    )
    verify.add_argument(
        "--staged",
        type=Path,
        help="tokcap: staged-calls JSON; gym: staged records (JSON array or JSONL, manifest order)",
    )
    verify.add_argument("--segments", choices=SEGMENT_MODES)
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
    if args.format != "tokcap":
        return _verify_gym(args)
    try:
        manifest_bytes = args.manifest.read_bytes()
        staged_bytes = args.staged.read_bytes() if args.staged else None
    except OSError as e:
        print(f"tokcap-core: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_IO_ERROR
    expected = _head(args.expected_head) if args.expected_head else None
    try:
        state = verify_manifest(decode_manifest(manifest_bytes), expected_head=expected)
        receipt = assemble_receipt(state, segments=args.segments or "terminal")
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


def _row_json(row: TrainingRow) -> dict[str, Any]:
    return {
        "token_ids": row.input_ids.tolist(),
        "loss_mask": row.loss_mask.tolist(),
        "logprobs": row.logprobs.tolist(),
        "weight_versions": [span.weight_version for span in row.call_spans],
        "call_ids": [span.call_id for span in row.call_spans],
        "prompt_len": row.prompt_len,
        "truncated": row.truncated,
        "reward": row.reward,
        "sample_mask": row.sample_mask,
        "reason": row.reason,
        "routes": None if row.routes is None else encode_routes(row.routes),
    }


def _verify_gym(args: argparse.Namespace) -> int:
    # Imported here: the tokcap format never pays for the interop modules.
    from .interop import gym

    try:
        main_bytes = args.manifest.read_bytes()
        staged_bytes = args.staged.read_bytes() if args.staged else None
    except OSError as e:
        print(f"tokcap-core: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_IO_ERROR
    try:
        if args.format == "gym-record":
            record = gym.decode_gym_staged_record(main_bytes)
            report: dict[str, Any] = {
                "record": {
                    "rollout_id": record.rollout_id,
                    "model_call_id": record.model_call_id,
                    "staging_key": record.staging_key,
                    "schema_version": record.schema_version,
                    "digest": record.digest,
                    "digest_verified": True,
                    "extras_verified": record.extras_loaded,
                }
            }
            print(json.dumps(report, indent=2))
            return EXIT_OK
        assert staged_bytes is not None
        receipt = gym.decode_gym_receipt(main_bytes)
        snapshots = [] if receipt.poisoned else gym.decode_gym_snapshots(staged_bytes)
        result = gym.verify_gym_rollout(receipt, snapshots)
    except TokcapError as e:
        print(json.dumps({"error": {"code": e.code, "message": e.message}}, indent=2))
        return EXIT_VERIFICATION_FAILED
    receipt_json = result.receipt.to_json()
    receipt_json["gym_reason"] = result.gym_reason
    receipt_json["gym_terminal_selection"] = receipt.terminal_selection
    print(json.dumps({"receipt": receipt_json, "row": _row_json(result.row)}, indent=2))
    return EXIT_OK if result.ok else EXIT_POISONED


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.format == "gym" and args.staged is None:
        parser.error("--format gym needs --staged SNAPSHOTS.json")
    if args.format == "gym-record" and args.staged is not None:
        parser.error("--format gym-record checks one record alone: no --staged")
    if args.format != "tokcap" and (args.segments or args.expected_head):
        parser.error("--segments and --expected-head apply to the tokcap format only")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "verify":
        _check_usage(parser, args)
        return _verify(args)
    try:
        count = assert_golden_vectors()
    except TokcapError as e:
        print(f"golden vectors FAILED: [{e.code}] {e.message}")
        return EXIT_VERIFICATION_FAILED
    print(f"golden vectors OK: {count} values recomputed")
    return EXIT_OK
