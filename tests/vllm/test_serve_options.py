"""``tokcap-vllm serve``'s gate options: derived from the config classes, checked before vLLM
starts (one line naming the option, exit 2), handed to the server as ``TOKCAP_<FIELD>``.

No engine: the CLI runs as a real process up to the point where it would become vLLM.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from tokcap_core import CaptureConfig, ConfigError
from tokcap_tq import TQSinkConfig
from tokcap_vllm import GateConfig
from tokcap_vllm.gate._config import SECRET_FIELDS, TRAINER_ONLY_FIELDS, gate_options
from tokcap_vllm.gate._served import describe_sink, served_gate, served_options
from tokcap_vllm.server._serve import gate_environ, server_argv

CLI = [sys.executable, "-c", "from tokcap_vllm.server._serve import main; main()"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def test_every_config_field_is_an_option_or_classified() -> None:
    fields = {o.field for o in served_options("tq")}
    for cls in (GateConfig, TQSinkConfig):
        assert {a.name for a in attrs.fields(cls)} - {"capture"} <= fields
    capture = {f.name for f in dataclasses.fields(CaptureConfig)}
    assert capture - fields == TRAINER_ONLY_FIELDS | SECRET_FIELDS
    flags = [o.flag for o in served_options("tq")]
    assert len(flags) == len(set(flags)), "two config classes share a field name"
    assert "--tokcap-control-token" not in flags


def test_help_exits_0_and_lists_the_options_with_defaults() -> None:
    done = _cli("serve", "--help")
    assert done.returncode == 0, done.stderr
    for option in served_options("tq"):
        assert option.flag in done.stdout
    assert "--tokcap-max-open-rollouts INT  (default: 100000" in done.stdout
    assert "--tokcap-ray-address TEXT  (required" in done.stdout
    assert "python -m vllm.entrypoints.openai.api_server --help" in done.stdout


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--tokcap-sink", "memory", "--tokcap-max-open-rollouts", "0"], "bad_max_open_rollouts"),
        (["--tokcap-sink", "memory", "--tokcap-stage-timeout-s", "soon"], "bad_stage_timeout_s"),
        (["--tokcap-sink=memory", "--tokcap-reasoning", "forget"], "bad_reasoning"),
        ([], "bad_sink"),
        (["--tokcap-sink", "nowhere"], "bad_sink"),
        (["--tokcap-sink", "tq"], "bad_ray_address"),
        (["--tokcap-sink", "memory", "--tokcap-control-token", "s3cret"], "bad_option"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_option_and_exit_2(args: list[str], code: str) -> None:
    done = _cli("serve", "some/model", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].endswith(f"[{code}]")
    assert "s3cret" not in done.stderr
    option = code.removeprefix("bad_").replace("_", "-")
    if code not in ("bad_option", "bad_sink"):
        assert f"--tokcap-{option}" in lines[0]


def test_an_external_sink_needs_the_control_token(tmp_path: Path) -> None:
    args = ["--tokcap-sink", "tq", "--tokcap-ray-address", "127.0.0.1:1"]
    with pytest.raises(ConfigError) as refused:
        gate_environ(args, {})
    assert refused.value.code == "token_required"
    env, _ = gate_environ(args, {"TOKCAP_CONTROL_TOKEN": "t"})
    assert env["TOKCAP_SINK"] == "tq"
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    env, _ = gate_environ([*args, "--tokcap-control-token-file", str(token_file)], {})
    assert GateConfig.from_environ(env).resolve_token(env) == "from-a-file"


def test_options_reach_the_server_as_variables_and_vllm_keeps_its_own() -> None:
    argv = ["--tokcap-sink", "memory", "--tokcap-require-open", "--max-model-len", "512"]
    env, rest = gate_environ(argv, {"TOKCAP_LEDGER_PATH": "/tmp/l.jsonl"})
    assert rest == ["--max-model-len", "512"]
    config = GateConfig.from_environ(env)
    assert config.require_open is True
    assert config.ledger_path == "/tmp/l.jsonl"
    served = served_gate(environ=env)
    assert served is not None
    assert served.sink_name == "memory"
    name, warnings = describe_sink(served.gate.sink)
    assert name == "memory"
    assert "no trainer can read" in warnings[0]


def test_every_option_round_trips_through_the_environment() -> None:
    texts = {
        "max_open_rollouts": "7",
        "reasoning_markers": "<think>,<reason>",
        "model_is_moe": "none",
        "stage_timeout_s": "2.5",
        "return_token_ids": "true",
        "on_render_mismatch": "break",
    }
    config = GateConfig.from_environ({f"TOKCAP_{k.upper()}": v for k, v in texts.items()})
    assert config.max_open_rollouts == 7
    assert config.reasoning_markers == ("<think>", "<reason>")
    assert config.capture.model_is_moe is None
    assert config.capture.stage_timeout_s == 2.5
    assert config.capture.return_token_ids is True
    assert config.on_render_mismatch == "break"
    assert GateConfig.from_environ({}) == GateConfig()
    assert {o.env for o in gate_options()} >= {"TOKCAP_LEDGER_PATH", "TOKCAP_REQUIRE_OPEN"}


def test_a_cpu_engine_serves_without_chunked_prefill_unless_told() -> None:
    cpu = {"VLLM_TARGET_DEVICE": "cpu"}
    assert "--no-enable-chunked-prefill" in server_argv("m", [], cpu)
    told = server_argv("m", ["--enable-chunked-prefill"], cpu)
    assert "--no-enable-chunked-prefill" not in told
