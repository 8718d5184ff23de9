"""``tokcap-core verify``: read the inputs within their bounds, verify, say what was covered.

Each path returns an `Outcome` (exit code, JSON report, human line); `_cli` prints it.
Inputs are read through `_read`: a file's size is checked with ``stat`` before any byte is
read, and every read (standard input included) is bounded, so an oversized input costs
no memory. An input the chosen ``--format`` refuses is sniffed, and a hint names the
format it looks like.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ._coverage import Uncovered, uncovered_calls
from ._errors import TokcapError, VerificationError
from ._manifest import MAX_MANIFEST_BYTES, decode_manifest, verify_manifest
from ._reassembly import verify_staged
from ._receipt import Receipt, assemble_receipt
from ._rows import TrainingRow
from ._staged import StagedCall
from ._staged_json import MAX_STAGED_BYTES, decode_staged_calls
from .provenance import check_staleness, receipt_staleness
from .routes import encode_routes

EXIT_OK: Final = 0
EXIT_POISONED: Final = 1
EXIT_USAGE: Final = 2
EXIT_VERIFICATION_FAILED: Final = 3
EXIT_IO_ERROR: Final = 4
FORMATS: Final = ("tokcap", "gym", "gym-record")
GYM_MAX_BYTES: Final = 256 * 1024 * 1024
GYM_UNBOUND: Final = {
    "reward": "NeMo-Gym's receipt binds no digest over the reward: it is carried as given",
    "terminal_model_call_id": "NeMo-Gym's receipt binds no witness: another captured call's "
    "chain would verify as well",
}
"""Fields of a Gym receipt no digest binds (each a documented change that still verifies)."""
UNPINNED_HEAD: Final = (
    "no --expected-head: the chain is consistent, but nothing pins it to the head kept "
    "when the rollout closed (a rewritten, re-hashed manifest would verify)"
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one command ended with."""

    code: int
    report: dict[str, Any]
    human: str


@dataclass(slots=True)
class _Inputs:
    main: bytes = b""
    staged: bytes | None = None
    report: dict[str, Any] = field(default_factory=dict)


class _ReadError(Exception):
    def __init__(self, code: str, message: str, exit_code: int) -> None:
        super().__init__(code, message, exit_code)
        self.code, self.message, self.exit_code = code, message, exit_code


def _read(name: str, limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of ``name`` (``-``: stdin); `_ReadError` past the bound."""
    try:
        if name == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise _ReadError(
                        "too_large", f"{what} {name} is {size} bytes, bound is {limit}", 3
                    )
                data = f.read(limit + 1)
    except OSError as e:
        raise _ReadError(
            "cannot_read", f"cannot read {e.filename or name}: {e.strerror}", 4
        ) from None
    if len(data) > limit:
        raise _ReadError("too_large", f"{what} {name} exceeds the bound of {limit} bytes", 3)
    return data


def verify_command(args: argparse.Namespace) -> Outcome:
    """Run ``verify`` for parsed ``args`` (usage already checked)."""
    gym = args.format != "tokcap"
    limits = (GYM_MAX_BYTES, GYM_MAX_BYTES) if gym else (MAX_MANIFEST_BYTES, MAX_STAGED_BYTES)
    inputs = _Inputs()
    try:
        inputs.main = _read(args.manifest, limits[0], "FILE")
        if args.staged is not None:
            inputs.staged = _read(args.staged, limits[1], "--staged")
    except _ReadError as e:
        return _failed(e.exit_code, e.code, e.message, None, {})
    try:
        if args.format == "tokcap":
            return _verify_tokcap(args, inputs)
        if args.format == "gym":
            return _verify_gym(inputs)
        return _verify_gym_record(inputs)
    except TokcapError as e:
        return _failed(3, e.code, e.message, _hint(args.format, inputs), inputs.report)


def _failed(
    code: int, error: str, message: str, hint: str | None, report: dict[str, Any]
) -> Outcome:
    doc: dict[str, Any] = {"code": error, "message": message}
    human = f"FAILED [{error}] {message}"
    if hint:
        doc["hint"] = hint
        human += f" (hint: {hint})"
    return Outcome(code, {"error": doc, **report}, human)


def _verify_tokcap(args: argparse.Namespace, inputs: _Inputs) -> Outcome:
    expected = None
    if args.expected_head:
        seq, _, digest = args.expected_head.partition(":")
        expected = (int(seq), digest)
    state = verify_manifest(decode_manifest(inputs.main), expected_head=expected)
    receipt = assemble_receipt(state, segments=args.segments or "all")
    report = inputs.report
    report["receipt"] = receipt.to_json()
    report["unbound"] = {} if expected else {"ledger_head": UNPINNED_HEAD}
    staged: list[StagedCall] = []
    if inputs.staged is not None:
        staged = decode_staged_calls(inputs.staged)
        if receipt.ok:
            segments = verify_staged(receipt, staged)
            report["staged"] = {
                "segments": len(segments),
                "calls_verified": sum(len(s) for s in segments),
                "tokens": sum(len(c.tokens) for s in segments for c in s),
            }
    uncovered = uncovered_calls(state, receipt, staged)
    report["uncovered"] = [u.to_json() for u in uncovered]
    if args.max_staleness is not None:
        _check_batch_staleness(args, receipt, report)
    return _covered_outcome(args.strict, receipt, uncovered, report)


def _check_batch_staleness(
    args: argparse.Namespace, receipt: Receipt, report: dict[str, Any]
) -> None:
    """Report each receipt's staleness against ``--trained-version``; raise
    `VerificationError` ``stale_tokens`` over ``--max-staleness`` (receipts alone)."""
    receipts = [receipt]
    for path in args.batch_manifest:
        try:
            data = _read(path, MAX_MANIFEST_BYTES, "--batch-manifest")
        except _ReadError as e:
            raise VerificationError(e.code, e.message) from e
        other = verify_manifest(decode_manifest(data))
        receipts.append(assemble_receipt(other, segments=args.segments or "all"))
    report["staleness"] = {
        "trained_version": args.trained_version,
        "max_staleness": args.max_staleness,
        "rollouts": {
            r.rollout_id: dataclasses.asdict(receipt_staleness(r, args.trained_version))
            for r in receipts
            if r.ok
        },
    }
    check_staleness(
        receipts,
        trained_version=args.trained_version,
        max_staleness=args.max_staleness,
        raise_=True,
    )


def _covered_outcome(
    strict: bool, receipt: Receipt, uncovered: Sequence[Uncovered], report: dict[str, Any]
) -> Outcome:
    listed = ", ".join(f"{u.call_id} ({u.reason}, staged {u.staged})" for u in uncovered)
    contradicting = [u for u in uncovered if u.staged == "differs_from_ledger"]
    if contradicting:
        ids = ", ".join(u.call_id for u in contradicting)
        return _failed(
            3, "digest_mismatch", f"staged rows differ from the ledger: {ids}", None, report
        )
    if strict and any(u.holds_tokens for u in uncovered):
        message = f"not covered by any verified segment: {listed}"
        return _failed(3, "uncovered", message, None, report)
    if not receipt.ok:
        return Outcome(
            EXIT_POISONED, report, f"poisoned {receipt.rollout_id}: {receipt.failure_reason}"
        )
    staged = report.get("staged")
    checked = (
        f"{staged['calls_verified']} staged calls, {staged['tokens']} tokens verified"
        if staged
        else "no staged rows checked (--staged)"
    )
    human = f"verified {receipt.rollout_id}: {len(receipt.segments)} segment(s), {checked}"
    if uncovered:
        human += f"; {len(uncovered)} uncovered: {listed}"
        if any(u.holds_tokens for u in uncovered):
            human += " (--strict fails on them)"
    return Outcome(EXIT_OK, report, human)


def _verify_gym(inputs: _Inputs) -> Outcome:
    # Imported here: the tokcap format never pays for the interop modules.
    from .interop import gym

    assert inputs.staged is not None
    receipt = gym.decode_gym_receipt(inputs.main)
    snapshots = [] if receipt.poisoned else gym.decode_gym_snapshots(inputs.staged)
    result = gym.verify_gym_rollout(receipt, snapshots)
    receipt_json = result.receipt.to_json()
    receipt_json["gym_reason"] = result.gym_reason
    receipt_json["gym_terminal_selection"] = receipt.terminal_selection
    report = inputs.report
    report.update(receipt=receipt_json, row=_row_json(result.row), unbound=dict(GYM_UNBOUND))
    chain = set(result.linearized.model_call_ids) if result.linearized else set()
    recorded = {r.model_call_id: r.digest for r in receipt.manifest}
    uncovered: list[Uncovered] = []
    if result.ok:
        by_id = {s.model_call_id: s for s in snapshots}
        for call_id, digest in recorded.items():
            if call_id not in chain:
                snap = by_id.get(call_id)
                match = "absent" if snap is None else "matches_ledger"
                if snap is not None and snap.digest != digest:
                    match = "differs_from_ledger"
                uncovered.append(
                    _gym_uncovered(receipt.rollout_id, call_id, "off_chain_branch", match)
                )
        uncovered.extend(
            _gym_uncovered(s.rollout_id, s.model_call_id, "not_recorded", "unrecorded")
            for s in snapshots
            if s.model_call_id not in recorded or s.rollout_id != receipt.rollout_id
        )
    report["uncovered"] = [u.to_json() for u in uncovered]
    return _covered_outcome(False, result.receipt, uncovered, report)


def _gym_uncovered(rollout_id: str, call_id: str, reason: Any, staged: Any) -> Uncovered:
    return Uncovered(
        call_id=call_id, staging_key=f"{rollout_id}/{call_id}", reason=reason, staged=staged
    )


def _verify_gym_record(inputs: _Inputs) -> Outcome:
    from .interop import gym

    record = gym.decode_gym_staged_record(inputs.main)
    report = {
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
    return Outcome(EXIT_OK, report, f"record {record.staging_key}: digest verified")


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


def _kind(data: bytes | None) -> str | None:
    """Which document ``data`` looks like: a format name, ``staged``/``gym-staged``, or None."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        first = data.lstrip()[:1]
        return "gym-staged" if first == b"{" and b'"token_ids_delta"' in data else None
    if isinstance(doc, list):
        return (
            "gym-staged"
            if doc and isinstance(doc[0], dict) and "token_ids_delta" in doc[0]
            else None
        )
    if not isinstance(doc, dict):
        return None
    fmt = doc.get("format")
    if isinstance(fmt, str) and fmt.startswith("tokcap/manifest/"):
        return "tokcap"
    if isinstance(fmt, str) and fmt.startswith("tokcap/staged/"):
        return "staged"
    if "token_ids_delta" in doc:
        return "gym-record"
    if "manifest" in doc and "schema_version" in doc:
        return "gym"
    return None


_HINTS: Final = {
    "tokcap": "FILE looks like a tokcap manifest: drop --format (or use --format tokcap)",
    "gym": "FILE looks like a NeMo-Gym RolloutReceipt: use --format gym --staged SNAPSHOTS",
    "gym-record": "FILE looks like one NeMo-Gym staged record: use --format gym-record",
    "staged": "FILE looks like tokcap staged calls: pass the manifest as FILE, this as --staged",
    "gym-staged": "FILE looks like NeMo-Gym staged records: pass them as --staged, the "
    "RolloutReceipt as FILE, with --format gym",
}


def _hint(fmt: str, inputs: _Inputs) -> str | None:
    """A hint when an input looks like another format than ``fmt`` expects."""
    kind = _kind(inputs.main)
    if kind is not None and kind != fmt:
        return _HINTS[kind]
    staged_kind = _kind(inputs.staged)
    expected = "staged" if fmt == "tokcap" else "gym-staged"
    if staged_kind is not None and staged_kind != expected:
        return (
            f"--staged looks like a {staged_kind} document, not {expected} ({_HINTS[staged_kind]})"
        )
    return None
