"""The ``tokcap-core`` command line, run as a user would: ``python -m tokcap_core``."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from tokcap_core import (
    Admitted,
    Closed,
    Failed,
    Ledger,
    Witnesses,
    encode_manifest,
    manifest_of,
)

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
    ledger.append(
        Admitted(
            call_id="c000001",
            parent_id=None,
            prefix_len=0,
            admitted_at=5,
            request_fingerprint="req",
        )
    )
    ledger.append(Failed(call_id="c000001", reason="stage_failed:timeout", served=True))
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
    assert result.stdout.startswith("golden vectors OK")
