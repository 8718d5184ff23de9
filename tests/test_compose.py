"""`tokcap.compose` and `tokcap.prepare_environment` without an engine (issue 23)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import anyio
import pytest

from tokcap_core import CaptureConfig, ConfigError


@dataclass(frozen=True)
class _Gate:
    model: str
    base_url: str

    def rollout_url(self, rollout_id: str) -> str:
        return f"{self.base_url}/r/{rollout_id}/v1"


def test_several_gates_need_a_routing_control_plane() -> None:
    from tokcap.compose import open_stack, tq_sink

    gates = [_Gate("m", "http://127.0.0.1:1"), _Gate("m", "http://127.0.0.1:2")]

    async def main() -> None:
        async with open_stack(
            gates, sink=tq_sink("t"), capture=CaptureConfig(), workers=1
        ):  # refused before anything starts
            pass

    with pytest.raises(ConfigError) as e:
        anyio.run(main)
    assert e.value.code == "bad_gates"


def test_tq_sink_partitions_follow_the_tag() -> None:
    from tokcap.compose import tq_sink

    config = tq_sink("my-run").config
    assert (config.staging_partition, config.training_partition) == (
        "my_run_staging",
        "my_run_rows",
    )


def test_collect_timings_add_up() -> None:
    from tokcap.compose import CollectTimings

    timings = CollectTimings(close_s=1.0, receipts_s=2.0, reassemble_s=3.0, rows_s=4.0)
    assert timings.total_s == 10.0


def test_importing_tokcap_sets_nothing_and_prepare_environment_keeps_what_is_set() -> None:
    """The environment is an explicit call at start-up, never an import side effect."""
    code = (
        "import os, sys; import tokcap, tokcap.demo, tokcap.tiny;"
        "assert 'VLLM_CPU_KVCACHE_SPACE' not in os.environ, 'set at import';"
        "assert 'torch' not in sys.modules;"
        "tokcap.prepare_environment();"
        "assert os.environ['VLLM_CPU_KVCACHE_SPACE'] == '1';"
        "assert os.environ['TQ_NUM_THREADS'] == '7'"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE",)}
    env["TQ_NUM_THREADS"] = "7"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("given", [None, "1"])
def test_the_engines_threads_leave_this_process_a_core_and_a_users_choice_is_kept(
    given: str | None,
) -> None:
    """Unset, ``OMP_NUM_THREADS`` becomes one fewer than the cores (at least 1), for the
    processes a run starts (the engine core); `use_driver_threads` puts this process's own
    torch back on every core. Set by the user, both keep it."""
    code = (
        "import os; import tokcap;"
        "tokcap.prepare_environment(); tokcap.use_driver_threads();"
        "import torch;"
        "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads(),"
        " len(os.sched_getaffinity(0)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if given is not None:
        env["OMP_NUM_THREADS"] = given
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    children, driver, cores = (int(n) for n in done.stdout.split())
    if given is None:
        assert (children, driver) == (max(1, cores - 1), cores)
    else:
        assert (children, driver) == (1, 1)  # with 2 or more cores, not what we would set


def test_clear_orphaned_clears_what_lost_rollouts_staged_and_only_over_a_fleet() -> None:
    from typing import Any

    from tokcap.compose import clear_orphaned

    class Sink:
        def __init__(self) -> None:
            self.keys = ["lost-1/c000001", "kept-2/c000001", "lost-3/c000002"]

        async def staged_keys(self) -> list[str]:
            return list(self.keys)

        async def clear(self, keys: list[str]) -> None:
            self.keys = [k for k in self.keys if k not in keys]

    class Fleet:  # what `GateFleet.orphaned_keys` answers for rollouts of a lost gate
        def orphaned_keys(self, keys: list[str]) -> list[str]:
            return [k for k in keys if k.startswith("lost-")]

    sink: Any = Sink()
    assert anyio.run(clear_orphaned, Fleet(), sink) == 2
    assert sink.keys == ["kept-2/c000001"]
    assert anyio.run(clear_orphaned, object(), sink) == 0  # one gate's control plane: nothing
    assert sink.keys == ["kept-2/c000001"]
