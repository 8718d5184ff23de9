"""The loop's meters and the sync step's timing: what a step records about where time went."""

from __future__ import annotations

import subprocess
import sys

import anyio

from tokcap.compose import CollectTimings
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


SPIN = "x = 0\nfor i in range(3_000_000): x += i\n"


def _metered(child: str, before: str | None = None) -> dict[str, float]:
    """What `CpuMeter.take` counts while a child runs ``child`` (Python), then stays alive
    (blocked on stdin) until it has been read; ``before`` runs to its end before `start`."""

    async def main() -> dict[str, float]:
        meter = CpuMeter()
        if before is not None:
            subprocess.run([sys.executable, "-c", before], check=True)
        await meter.start()
        busy = subprocess.Popen(
            [sys.executable, "-c", child + "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            await anyio.sleep(0.5)
            return await meter.take()
        finally:
            busy.communicate(b"")

    return anyio.run(main)


def test_cpu_meter_counts_a_child_process_and_not_what_came_before_start() -> None:
    used = _metered(SPIN, before=SPIN)
    assert set(used) == {"cpu", "cpu_engine", "cpu_driver"}
    assert used["cpu"] > 0.0
    assert used["cpu"] >= used["cpu_driver"]
    assert used["cpu_engine"] == 0.0  # no engine core below this process


def test_cpu_meter_counts_a_process_named_as_vllms_engine_core_as_the_engines() -> None:
    named = "import setproctitle; setproctitle.setproctitle('VLLM::EngineCore')\n"
    used = _metered(named + SPIN)  # named as vLLM names its engine core process
    assert used["cpu_engine"] > 0.0
    assert used["cpu"] >= used["cpu_engine"] + used["cpu_driver"] - 1e-9


def _episodes(groups: int, rollouts: int) -> list[DigitsEpisode]:
    return [
        DigitsEpisode(rollout_id=f"t-g{g}-r{i}", group_id=f"t-g{g}", witness="none", prompt="p")
        for g in range(groups)
        for i in range(rollouts)
    ]


def test_the_tail_keeps_the_last_answer_and_splits_the_rest_at_the_verified_receipts() -> None:
    episodes = _episodes(2, 2)
    tail = StepTail(10.0, episodes)
    for episode, answered in zip(episodes, [11.0, 13.0, 12.0, 12.5], strict=True):
        tail.played(episode, answered)
    assert tail.last_answer == 13.0
    seconds = tail.seconds(14.0)  # nothing collected: all of it after the answer is left
    assert (seconds["generate"], seconds["capture_verify"], seconds["reassemble"]) == (3, 0, 1)
    tail.collect_started = 13.25
    tail.timings = CollectTimings(close_s=0.5, receipts_s=0.25, reassemble_s=0.5, rows_s=0.25)
    seconds = tail.seconds(15.0)
    assert seconds["capture_verify"] == 1.0  # until the receipts were verified: 14.0
    assert seconds["reassemble"] == 1.0
    assert (seconds["close"], seconds["fetch_receipts"]) == (0.5, 0.25)
    assert (seconds["pool"], seconds["read_rows"]) == (0.5, 0.25)
