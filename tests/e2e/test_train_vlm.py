"""``tokcap train --model-family idefics3``: the closed loop on the tiny vision-language model.

Two steps on the session's TransferQueue (``--ray-address``, as in ``test_train.py``): every
rollout's first message carries its group's image; the gate stages each image's processed
tensors once in the sink; the trainer reads them back, verified, for its forward pass and
reports its parity with the engine. Outcomes only: no assertion reads a duration.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from tests.e2e._cli import tokcap

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, GROUPS, ROLLOUTS = 2, 2, 2
HANG_GUARD_S = 1800


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory: pytest.TempPathFactory, tq_cluster: Any) -> dict[str, Any]:
    import ray

    out = tmp_path_factory.mktemp("train-vlm") / "run"
    proc = tokcap(
        "train", "--model-family", "idefics3", "--steps", str(STEPS), "--groups", str(GROUPS),
        "--rollouts", str(ROLLOUTS), "--task", "digits", "--max-tokens", "8", "--seed", "0",
        "--out", out,
        "--ray-address", ray.get_runtime_context().gcs_address, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"tokcap train failed ({proc.returncode}):\n{proc.stdout}\n" + (proc.stderr[-4000:])
    )
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def test_every_step_trains_on_verified_images_with_every_receipt_verified(
    vlm_run: dict[str, Any],
) -> None:
    steps = vlm_run["train"]["steps"]
    assert vlm_run["config"]["model_family"] == "idefics3"
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["receipts_verified"] == s["receipts_total"] == GROUPS * ROLLOUTS
        assert (s["rows_valid"], s["rows_placeholder"]) == (GROUPS * ROLLOUTS, 0)
        # one image per rollout: sent, bound by its receipt, named by its row
        assert s["images_sent"] == s["images_bound"] == s["images"] == GROUPS * ROLLOUTS
        assert s["image_blobs"] == GROUPS  # a group's rollouts share their image's blob
        assert s["parity"]["tokens"] > 0
        assert s["parity"]["k3"] <= vlm_run["train"]["parity_k3_limit"]
    train = vlm_run["train"]
    assert train["images_sent"] == train["images"] == STEPS * GROUPS * ROLLOUTS
    assert train["image_blobs"] == STEPS * GROUPS


def test_each_push_lands_and_the_next_step_samples_and_encodes_with_it(
    vlm_run: dict[str, Any],
) -> None:
    """Step 1's rows (the same images as step 0's) were sampled by the version step 0
    pushed, the engine serving it: their parity with the trainer holding those weights is
    the K3 bar, so the engine encoded the images again with the new weights."""
    first, second = vlm_run["train"]["steps"]
    assert first["engine_version"] == str(first["weight_version"])
    assert second["sampled_version"] == first["weight_version"] < second["weight_version"]
    assert second["parity"]["k3"] <= vlm_run["train"]["parity_k3_limit"]


def test_the_runs_images_are_freed_with_its_rows(vlm_run: dict[str, Any]) -> None:
    from tokcap.compose import tq_sink

    sink = tq_sink("train")  # the partitions of `tokcap train`'s tag

    async def held() -> tuple[list[Any], list[Any], list[Any]]:
        return await sink.media_keys(), await sink.staged_keys(), await sink.row_keys()

    assert anyio.run(held, backend="asyncio") == ([], [], [])
