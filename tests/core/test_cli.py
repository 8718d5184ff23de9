"""The ``tokcap-core`` command line, run as a user would: ``python -m tokcap_core``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from tokcap_core import Ledger
from tokcap_core.ledger import Closed, Failed, Witnesses, encode_manifest, manifest_of
from tokcap_core.simulate import admit_call

EXAMPLES = resources.files("tokcap_core").joinpath("examples")


def example(name: str) -> Path:
    path = Path(str(EXAMPLES.joinpath(name)))
    assert path.is_file()
    return path


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokcap_core", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def report(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_verify_of_the_shipped_example_exits_0_with_a_verified_receipt() -> None:
    result = cli("verify", example("manifest.json"), "--staged", example("staged.json"))
    assert result.returncode == 0, result.stderr
    doc = report(result)
    assert doc["receipt"]["status"] == "verified"
    assert (
        doc["staged"]["calls_verified"] == sum(len(seg) for seg in doc["receipt"]["segments"]) > 0
    )


def test_verify_with_all_segments_reports_the_forest() -> None:
    result = cli(
        "verify", example("manifest.json"), "--staged", example("staged.json"), "--segments", "all"
    )
    assert result.returncode == 0, result.stderr
    assert report(result)["staged"]["segments"] == len(report(result)["receipt"]["segments"]) == 2


def test_a_tampered_manifest_exits_3_with_an_error_code(tmp_path: Path) -> None:
    data = example("manifest.json").read_bytes()
    at = data.index(b'"request_fingerprint":"req-') + len(b'"request_fingerprint":"req-')
    tampered = tmp_path / "manifest.json"
    tampered.write_bytes(data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :])
    result = cli("verify", tampered, "--staged", example("staged.json"))
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "bad_entry_hash"


def test_tampered_staged_rows_exit_3_with_an_error_code(tmp_path: Path) -> None:
    doc = json.loads(example("staged.json").read_bytes())
    doc["calls"][-1]["tokens"][0] ^= 1  # the terminal call, on segment 0
    staged = tmp_path / "staged.json"
    staged.write_text(json.dumps(doc))
    result = cli("verify", example("manifest.json"), "--staged", staged)
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "digest_mismatch"


def test_a_head_other_than_the_one_kept_at_close_exits_3() -> None:
    result = cli("verify", example("manifest.json"), "--expected-head", f"1:{'00' * 32}")
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "unexpected_head"


def test_a_poisoned_rollout_exits_1(tmp_path: Path) -> None:
    ledger = Ledger("poisoned-run")
    call_id = admit_call(ledger, None, admitted_at=5, request_fingerprint="req")
    ledger.append(Failed(call_id=call_id, reason="stage_failed:timeout", served=True))
    ledger.append(Closed(reward=1.0, witnesses=Witnesses()))
    path = tmp_path / "manifest.json"
    path.write_bytes(encode_manifest(manifest_of(ledger)))
    result = cli("verify", path)
    assert result.returncode == 1
    assert report(result)["receipt"]["failure_reason"] == "stage_failed:timeout"


def test_a_missing_file_exits_4(tmp_path: Path) -> None:
    result = cli("verify", tmp_path / "nowhere.json")
    assert result.returncode == 4
    assert "nowhere.json" in result.stderr


def test_a_usage_error_exits_2() -> None:
    assert cli("frobnicate").returncode == 2


def test_golden_exits_0() -> None:
    result = cli("golden")
    assert result.returncode == 0
    assert report(result)["golden"]["values"] > 0
    assert result.stderr.startswith("tokcap-core golden: golden vectors OK")


# ---- --format gym / gym-record -------------------------------------------------------


def gym_files(tmp_path: Path, receipt: Any, snapshots: Any) -> tuple[Path, Path]:
    receipt_path, staged_path = tmp_path / "receipt.json", tmp_path / "snapshots.json"
    receipt_path.write_text(json.dumps(receipt))
    staged_path.write_text(json.dumps(snapshots))
    return receipt_path, staged_path


def test_a_gym_capture_verifies_with_the_row_printed(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import capture_json, worked_example

    receipt_path, staged_path = gym_files(tmp_path, *capture_json(worked_example()))
    result = cli("verify", "--format", "gym", receipt_path, "--staged", staged_path)
    assert result.returncode == 0, result.stderr
    doc = report(result)
    assert doc["receipt"]["status"] == "verified"
    assert doc["receipt"]["terminal_call_id"] == "c2"
    assert doc["receipt"]["failure_reason"] is None
    assert doc["receipt"]["gym_reason"] is None
    assert doc["row"]["token_ids"] == [10, 11, 12, 13, 20, 21, 22]
    assert doc["row"]["loss_mask"] == [0, 0, 1, 1, 0, 1, 1]
    assert len(doc["row"]["logprobs"]) == 7
    assert doc["row"]["weight_versions"] == [3, 4]


def test_gym_snapshots_may_be_json_lines(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import capture_json, worked_example

    receipt, snapshots = capture_json(worked_example())
    receipt_path, staged_path = gym_files(tmp_path, receipt, [])
    staged_path.write_text("".join(json.dumps(s) + "\n" for s in snapshots))
    assert cli("verify", "--format", "gym", receipt_path, "--staged", staged_path).returncode == 0


def test_a_poisoned_gym_receipt_exits_1_with_gyms_reason(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import capture_json, worked_example

    capture = worked_example(poisoned=True, failure_reason="worker_capture_failed")
    receipt_path, staged_path = gym_files(tmp_path, *capture_json(capture))
    result = cli("verify", "--format", "gym", receipt_path, "--staged", staged_path)
    assert result.returncode == 1
    doc = report(result)
    assert doc["receipt"]["status"] == "poisoned"
    assert doc["receipt"]["gym_reason"] == "worker_capture_failed"
    assert doc["receipt"]["failure_reason"] == "stage_failed:worker_capture_failed"
    assert doc["row"]["loss_mask"] == [0]


def test_a_tampered_gym_capture_exits_3_with_gyms_code(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import capture_json, worked_example

    receipt, snapshots = capture_json(worked_example())
    receipt["manifest"][1]["weight_version"] += 1
    result = cli("verify", "--format", "gym", *gym_files(tmp_path, receipt, snapshots)[:1],
                 "--staged", tmp_path / "snapshots.json")  # fmt: skip
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "wrong_weight_version"
    receipt, snapshots = capture_json(worked_example())
    snapshots[1]["token_ids_delta"][0] += 1
    receipt_path, staged_path = gym_files(tmp_path, receipt, snapshots)
    result = cli("verify", "--format", "gym", receipt_path, "--staged", staged_path)
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "corrupt_digest"


def test_every_tamper_of_a_gym_capture_is_rejected_through_the_cli(
    tmp_path: Path, capsys: Any
) -> None:
    """In process (the same ``main`` the console script runs), one exit code per tamper."""
    from tests.core.interop.gymkit import (
        capture_json,
        list_tampers,
        outcome,
        tampers,
        vocabulary,
        worked_example,
    )
    from tests.core.interop.tamper_rules import classify
    from tokcap_core._cli import main

    receipt, snapshots = capture_json(worked_example())
    base = outcome(receipt, snapshots)
    stranger = worked_example("other").snapshots[0].to_json()
    cases: list[tuple[str, Any, Any, str]] = []
    for path, doc in tampers(receipt, vocabulary(receipt)):
        kind = classify(path, receipt, base, outcome(doc, snapshots), in_receipt=True)
        cases.append((str(path), doc, snapshots, kind))
    for path, doc in tampers(snapshots, vocabulary(receipt)):
        kind = classify(path, snapshots, base, outcome(receipt, doc), in_receipt=False)
        cases.append((str(path), receipt, doc, kind))
    cases.extend(
        (label, receipt, docs, "detected") for label, docs in list_tampers(snapshots, stranger)
    )
    rejected = 0
    for label, receipt_doc, snapshot_docs, kind in cases:
        receipt_path, staged_path = gym_files(tmp_path, receipt_doc, snapshot_docs)
        code = main(["verify", "--format", "gym", str(receipt_path), "--staged", str(staged_path)])
        capsys.readouterr()
        if kind == "detected":
            assert code in (1, 3), label
            rejected += 1
        else:
            assert code == 0, label
    assert rejected > 150


def test_gym_record_checks_one_record(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import worked_example

    record = worked_example().snapshots[1].to_json()
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    result = cli("verify", "--format", "gym-record", path)
    assert result.returncode == 0, result.stderr
    assert report(result)["record"]["staging_key"] == "g7_r0/c2"
    assert report(result)["record"]["digest_verified"] is True
    record["generation_log_probs_delta"][1] = -0.5
    path.write_text(json.dumps(record))
    result = cli("verify", "--format", "gym-record", path)
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "corrupt_digest"
    record["schema_version"] = 9
    path.write_text(json.dumps(record))
    assert report(cli("verify", "--format", "gym-record", path))["error"]["code"] == (
        "unsupported_schema"
    )


def test_gym_usage_errors_exit_2_and_missing_files_4(tmp_path: Path) -> None:
    some = tmp_path / "x.json"
    some.write_text("{}")
    assert cli("verify", "--format", "gym", some).returncode == 2
    assert cli("verify", "--format", "gym-record", some, "--staged", some).returncode == 2
    assert (
        cli("verify", "--format", "gym", some, "--staged", some, "--segments", "all").returncode
        == 2
    )
    assert cli("verify", "--format", "nemo", some).returncode == 2
    missing = cli("verify", "--format", "gym", tmp_path / "gone.json", "--staged", some)
    assert missing.returncode == 4
    assert "gone.json" in missing.stderr
    assert cli("verify", "--format", "gym", some, "--staged", some).returncode == 3


# ---- a verifier a CI job can trust ---------------------------------------------------


def forest(tmp_path: Path, *, extra: Any = None) -> tuple[Path, Path, dict[str, Any]]:
    """A two-root rollout: the second root is covered by ``--segments all`` only."""
    from tokcap_core.simulate import simulate_rollout
    from tokcap_core.staged import encode_staged_calls

    rollout = simulate_rollout("forest", seed=3, turns=2, roots=2)
    calls = list(rollout.calls)
    if extra is not None:
        calls.append(extra)
    manifest, staged = tmp_path / "manifest.json", tmp_path / "staged.json"
    manifest.write_bytes(encode_manifest(rollout.manifest))
    staged.write_bytes(encode_staged_calls(calls))
    return manifest, staged, json.loads(staged.read_bytes())


def test_a_usage_error_exits_2_with_a_json_error_and_one_line() -> None:
    result = cli("verify", example("manifest.json"), "--expected-head", "foo")
    assert result.returncode == 2
    assert report(result)["error"]["code"] == "usage"
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--expected-head" in result.stderr


def test_help_exits_0_and_lists_the_exit_codes() -> None:
    for args in (("--help",), ("verify", "--help"), ("golden", "--help")):
        result = cli(*args)
        assert result.returncode == 0, args
        assert "exit codes:" in result.stdout
        assert "3  verification failed" in result.stdout


def test_the_default_verifies_every_root_and_reports_what_stays_uncovered(
    tmp_path: Path,
) -> None:
    manifest, staged, _ = forest(tmp_path)
    default = report(cli("verify", manifest, "--staged", staged))
    assert len(default["receipt"]["segments"]) == 2
    assert default["uncovered"] == []
    terminal = cli("verify", manifest, "--staged", staged, "--segments", "terminal")
    assert terminal.returncode == 0
    uncovered = report(terminal)["uncovered"]
    assert {u["reason"] for u in uncovered} == {"other_root"}
    assert {u["staged"] for u in uncovered} == {"matches_ledger"}
    assert "uncovered" in terminal.stderr
    strict = cli("verify", manifest, "--staged", staged, "--segments", "terminal", "--strict")
    assert strict.returncode == 3
    assert report(strict)["error"]["code"] == "uncovered"
    assert all(u["call_id"] in report(strict)["error"]["message"] for u in uncovered)


def test_a_flipped_byte_in_a_call_outside_the_segments_fails(tmp_path: Path) -> None:
    manifest, staged, doc = forest(tmp_path)
    first_root = doc["calls"][0]  # the first root: off the terminal's chain
    first_root["tokens"][0] ^= 1
    staged.write_text(json.dumps(doc))
    result = cli("verify", manifest, "--staged", staged, "--segments", "terminal")
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "digest_mismatch"
    assert first_root["call_id"] in report(result)["error"]["message"]


def test_an_unknown_staged_call_is_reported_and_fails_under_strict(tmp_path: Path) -> None:
    from tokcap_core.simulate import simulate_rollout

    stranger = simulate_rollout("stranger", seed=9, turns=1).calls[0]
    manifest, staged, _ = forest(tmp_path, extra=stranger)
    result = cli("verify", manifest, "--staged", staged)
    assert result.returncode == 0
    (uncovered,) = report(result)["uncovered"]
    assert uncovered == {
        "call_id": stranger.call_id,
        "staging_key": stranger.key,
        "reason": "not_recorded",
        "why": "staged, but no ledger entry of this rollout names it",
        "staged": "unrecorded",
    }
    strict = cli("verify", manifest, "--staged", staged, "--strict")
    assert strict.returncode == 3
    assert stranger.key.split("/")[1] in report(strict)["error"]["message"]


def test_a_call_that_failed_before_it_was_served_is_reported_but_not_strict_failure() -> None:
    result = cli("verify", example("manifest.json"), "--staged", example("staged.json"), "--strict")
    assert result.returncode == 0, result.stdout
    (failed,) = report(result)["uncovered"]
    assert (failed["reason"], failed["staged"]) == ("failed_before_served", "absent")


def test_an_unpinned_head_is_marked_unbound() -> None:
    unpinned = report(cli("verify", example("manifest.json")))
    assert "ledger_head" in unpinned["unbound"]
    head = unpinned["receipt"]["ledger_head"]
    pinned = cli(
        "verify", example("manifest.json"), "--expected-head", f"{head['seq']}:{head['hash']}"
    )
    assert pinned.returncode == 0
    assert report(pinned)["unbound"] == {}


def test_gyms_reward_is_marked_unbound(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import capture_json, worked_example

    receipt, snapshots = capture_json(worked_example())
    receipt["reward"] = 5.0
    receipt_path, staged_path = gym_files(tmp_path, receipt, snapshots)
    result = cli("verify", "--format", "gym", receipt_path, "--staged", staged_path)
    assert result.returncode == 0
    assert report(result)["receipt"]["reward"] == 5.0
    assert "binds no digest" in report(result)["unbound"]["reward"]


def test_a_gym_receipt_without_format_gym_gets_a_hint(tmp_path: Path) -> None:
    from tests.core.interop.gymkit import capture_json, worked_example

    receipt_path, staged_path = gym_files(tmp_path, *capture_json(worked_example()))
    result = cli("verify", receipt_path, "--staged", staged_path)
    assert result.returncode == 3
    assert "--format gym" in report(result)["error"]["hint"]
    assert "--format gym" in result.stderr
    manifest = cli("verify", "--format", "gym", example("manifest.json"), "--staged", staged_path)
    assert "tokcap manifest" in report(manifest)["error"]["hint"]


def test_stdin_is_read_with_a_dash() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokcap_core",
            "verify",
            "-",
            "--staged",
            str(example("staged.json")),
        ],
        input=example("manifest.json").read_bytes(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["staged"]["calls_verified"] == 8
    assert cli("verify", "-", "--staged", "-").returncode == 2


def _peak_rss_kib(*args: str | Path, code: int = 3) -> tuple[int, bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokcap_core", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == code, out
    return usage.ru_maxrss, out


def test_oversized_inputs_are_refused_before_they_are_read(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: reading it would cost 1 GiB of memory
    # A child's peak includes what the forking test process held (Linux keeps it across
    # exec), which depends on what ran before in this process: compare with the peak of
    # verifying the small example, forked from the same process.
    baseline, _ = _peak_rss_kib("verify", example("manifest.json"), code=0)
    for args in (("verify", big), ("verify", example("manifest.json"), "--staged", big)):
        rss_kib, out = _peak_rss_kib(*args)
        assert json.loads(out)["error"]["code"] == "too_large"
        assert rss_kib - baseline < 256 * 1024, (rss_kib, baseline)


def test_an_unreadable_file_is_a_json_error_on_stdout_and_one_line_on_stderr(
    tmp_path: Path,
) -> None:
    result = cli("verify", tmp_path / "nowhere.json")
    assert result.returncode == 4
    assert report(result)["error"]["code"] == "cannot_read"
    (line,) = result.stderr.strip().splitlines()
    assert "nowhere.json" in line


def test_verify_checks_an_image_bearing_capture_and_a_changed_image_digest(tmp_path: Path) -> None:
    """Format v4 from the CLI alone (no torch): the golden two-turn image rollout verifies;
    one media item's byte digest changed in a staged row fails it."""
    from tokcap_core.golden import shipped_vectors

    (case,) = [r for r in shipped_vectors()["rollouts"] if r["name"] == "images-two-turns"]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(case["manifest"]))
    staged = tmp_path / "staged.json"
    doc = {"format": "tokcap/staged/v4", "calls": case["staged"]}
    staged.write_text(json.dumps(doc))
    result = cli("verify", manifest, "--staged", staged)
    assert result.returncode == 0, result.stderr
    assert report(result)["staged"]["calls_verified"] == 2
    doc["calls"][1]["media"][0]["tensors_digest"] = "00" * 32
    staged.write_text(json.dumps(doc))
    result = cli("verify", manifest, "--staged", staged)
    assert result.returncode == 3
    assert report(result)["error"]["code"] == "digest_mismatch"
