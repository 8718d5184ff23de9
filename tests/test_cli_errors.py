"""Every command line answers ``--help`` with exit 0 and ends an error in one line, never a
traceback; ``scripts/demo.sh --help`` answers without running the set-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tokcap(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokcap", *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("command", [(), ("demo",), ("train",), ("show",), ("bench",), ("verify",)])
def test_help_exits_0_and_names_the_command(command: tuple[str, ...]) -> None:
    result = tokcap(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {' '.join(('tokcap', *command))}")


def test_show_describes_its_argument() -> None:
    assert "a run folder (.tokcap/runs/...) or its summary.json" in tokcap("show", "--help").stdout


def test_show_on_anything_but_a_summary_is_one_line(tmp_path: Path) -> None:
    other = tmp_path / "manifest.json"
    other.write_text(json.dumps({"format": "tokcap/manifest/v2", "entries": []}))
    result = tokcap("show", other)
    assert result.returncode == 3
    assert "is not a tokcap run summary" in one_line(result)
    assert result.stdout == ""
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "is not JSON" in one_line(tokcap("show", text))
    missing = tokcap("show", tmp_path / "nowhere")
    assert missing.returncode == 4
    assert "cannot read" in one_line(missing)


def test_a_usage_error_is_exit_2() -> None:
    result = tokcap("demo", "--groups", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "code"),
    [
        (("--rollouts", "1"), "bad_rollouts"),
        (("--task", "agent", "--turns", "1"), "bad_turns"),
        (("--gate", "http://127.0.0.1:9"), "bad_gates"),
        (("--model-family", "idefics3", "--gates", "2"), "bad_model_family"),
    ],
)
def test_a_train_option_the_loop_refuses_is_exit_2_before_anything_starts(
    flags: tuple[str, ...], code: str, tmp_path: Path
) -> None:
    result = tokcap("train", *flags, "--out", tmp_path / "run")
    assert result.returncode == 2
    assert one_line(result).startswith(f"tokcap train: [{code}] ")
    assert not (tmp_path / "run").exists()  # refused before the model, Ray or an engine


def test_demo_sh_help_answers_without_the_set_up() -> None:
    result = subprocess.run(
        ["bash", "scripts/demo.sh", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage: tokcap demo" in result.stdout
    assert "--quick" in result.stdout
    assert "setup:" not in result.stderr  # scripts/setup.sh says "setup: ok" when it runs
