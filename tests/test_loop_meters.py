"""The loop's meters and the sync step's timing: what a step records about where time went."""

from __future__ import annotations

import subprocess
import sys

import anyio

from tokcap.compose import Batch
from tokcap.loop import BusyMeter, CpuMeter, DigitsEpisode, StepTail


def test_busy_meter_counts_only_the_time_a_call_is_out_and_averages_the_count() -> None:
    meter = BusyMeter()
    idle = meter.take()
    assert (idle["engine_busy"], idle["in_flight"]) == (0.0, 0.0)  # nothing went out
    meter.enter()
    meter.enter()
    meter.leave()
    meter.leave()
    figures = meter.take()
    assert figures["engine_busy"] > 0.0
    assert 1.0 <= figures["in_flight"] <= 2.0
    assert figures["window"] >= figures["engine_busy"]
    assert meter.take()["engine_busy"] == 0.0  # a new window starts at each take


def test_cpu_meter_counts_a_child_process_and_not_what_came_before_start() -> None:
    async def main() -> dict[str, float]:
        meter = CpuMeter()
        spin = "x = 0\nfor i in range(3_000_000): x += i\n"
        subprocess.run([sys.executable, "-c", spin], check=True)  # before start: not counted
        await meter.start()
        # a child that spins, then stays alive (blocked on stdin) until it has been read
        busy = subprocess.Popen(
            [sys.executable, "-c", spin + "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            await anyio.sleep(0.5)
            return await meter.take()
        finally:
            busy.communicate(b"")

    used = anyio.run(main)
    assert set(used) == {"cpu", "cpu_engine", "cpu_driver"}
    assert used["cpu"] > 0.0
    assert used["cpu"] >= used["cpu_driver"]
    assert used["cpu_engine"] == 0.0  # no engine core below this process


def _episodes(groups: int, rollouts: int) -> list[DigitsEpisode]:
    return [
        DigitsEpisode(rollout_id=f"t-g{g}-r{i}", group_id=f"t-g{g}", witness="none", prompt="p")
        for g in range(groups)
        for i in range(rollouts)
    ]


def test_the_tail_names_a_group_once_its_last_rollout_played_and_keeps_the_last_answer() -> None:
    episodes = _episodes(2, 2)
    tail = StepTail(10.0, episodes)
    assert tail.played(episodes[0], 11.0) is None
    assert tail.played(episodes[2], 13.0) is None
    assert tail.played(episodes[1], 12.0) == "t-g0"
    assert tail.played(episodes[3], 12.5) == "t-g1"
    assert tail.last_answer == 13.0
    seconds = tail.seconds(14.0)  # no group collected: all of it after the answer is left
    assert seconds["generate"] == 3.0
    assert seconds["capture_verify"] == 0.0
    assert seconds["reassemble"] == 1.0
    assert seconds["overlapped"] == 0.0


def test_the_tail_merges_group_batches_in_group_order() -> None:
    tail = StepTail(0.0, _episodes(2, 2))
    tail._batches["t-g1"] = Batch(advantages=[1.0, -1.0])
    tail._batches["t-g0"] = Batch(advantages=[0.5, -0.5])
    assert tail.batch().advantages == [0.5, -0.5, 1.0, -1.0]
