"""``tokcap train --model-family idefics3`` without an engine: its config, its images and
the image counts of its summary and checks, from records; and the terminal counts every
run's summary gives (how the verified receipts chose their terminal calls)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.train.records import clean_step, printed
from tokcap.loop import (
    LoopConfig,
    StepRecord,
    TrainRun,
    build_train_summary,
    group_image,
    loop_config,
    render_train_report,
    train_problems,
)
from tokcap_core import ConfigError


def _record(
    step: int, images_sent: int = 0, images_bound: int = 0, images: int = 0, image_blobs: int = 0
) -> StepRecord:
    return clean_step(
        step, rows_valid=4, receipts_verified=4, receipts_total=4, tokens=40,
        images_sent=images_sent, images_bound=images_bound, images=images, image_blobs=image_blobs,
    )  # fmt: skip


IMAGES = {"images_sent": 4, "images_bound": 4, "images": 4, "image_blobs": 2}


def _summary(*records: StepRecord) -> dict[str, Any]:
    run = TrainRun(LoopConfig(model=Path("tiny"), steps=len(records), model_family="idefics3"))
    run.steps = list(records)
    return build_train_summary(run, {})


def test_the_summary_counts_images_per_step_and_in_total_and_prints_them() -> None:
    summary = _summary(_record(0, **IMAGES), _record(1, **IMAGES))
    train = summary["train"]
    assert train["steps"][1]["images_bound"] == 4
    assert {k: train[k] for k in IMAGES} == {k: 2 * v for k, v in IMAGES.items()}
    assert train_problems(summary) == []
    assert "images: 8 sent, 8 bound by the verified receipts, 8 in the trained rows; 4 blobs" in (
        printed(summary, width=200)
    )


def test_an_image_sent_but_not_bound_or_not_in_its_row_is_a_problem() -> None:
    unbound = _record(0, **{**IMAGES, "images_bound": 3})
    unread = _record(1, **{**IMAGES, "image_blobs": 0})
    assert train_problems(_summary(unbound, unread)) == [
        "step 0: 4 images sent, 3 bound by the receipts, 4 in the rows",
        "step 1: rows name images but no blob was read back",
    ]
    # a row lost to a placeholder takes its image with it: not counted against the step
    lost = replace(unbound, rows_valid=3, rows_placeholder=1, images=3)
    assert train_problems(_summary(lost)) == []


def test_a_text_run_has_no_image_counts() -> None:
    run = TrainRun(LoopConfig(model=Path("tiny"), steps=1))
    run.steps = [_record(0)]
    summary = build_train_summary(run, {})
    assert summary["config"]["model_family"] == "qwen"
    assert "images_sent" not in summary["train"]
    assert "images_sent" not in summary["train"]["steps"][0]


def test_the_family_picks_the_tiny_model_and_idefics3_plays_chat_on_one_gate() -> None:
    vlm = loop_config({"model_family": "idefics3", "task": "digits"})
    assert vlm.model.parts[-2:] == ("tiny", "vlm")  # the tiny VLM's cache folder
    assert loop_config({"task": "digits"}).model.parts[-2:] == ("tiny", "dense")
    assert loop_config({"model_family": "idefics3", "task": "digits"}).images
    for flags in (
        {"model_family": "llava"},
        {"model_family": "idefics3", "gates": 2},
        {"model_family": "idefics3", "harness_api": "responses"},
    ):
        with pytest.raises(ConfigError) as refused:
            loop_config(flags)
        assert refused.value.code == "bad_model_family"


def test_a_groups_image_is_a_png_that_decodes_the_same_every_time_and_differs_by_group() -> None:
    from PIL import Image

    first = group_image(0, 0)
    assert first == group_image(0, 0)
    assert first != group_image(0, 1) != group_image(1, 1)
    image = Image.open(io.BytesIO(first))
    assert (image.format, image.mode, image.size) == ("PNG", "RGB", (48, 48))
    image.load()  # the pixel data decodes (CRCs and zlib stream intact)


TERMINALS = {"content": 1, "declared": 1, "heuristic": 1, "response_id": 1}


def test_the_summary_counts_terminals_by_how_the_receipts_chose_them_and_prints_them() -> None:
    summary = _summary(*(replace(_record(i), terminals=TERMINALS, declared=1) for i in (0, 1)))
    assert summary["train"]["terminals"] == {k: 2 for k in TERMINALS}
    assert train_problems(summary) == []
    out = printed(summary, width=200)
    assert "(terminals: content 2, declared 2, heuristic 2, response_id 2)" in out
    page = render_train_report(summary)
    assert '<div class="card ok"><b>2 / 2</b><span>declared terminals chosen / declared' in page


def test_a_declared_terminal_the_receipts_did_not_choose_is_a_problem() -> None:
    """Each rollout that declared through its close must have a receipt that chose the
    declared call; a step whose receipts failed says so instead."""
    missed = replace(_record(0), terminals={**TERMINALS, "declared": 1}, declared=2)
    failed = replace(_record(1), terminals=missed.terminals, declared=2, receipts_verified=3)
    assert train_problems(_summary(missed, failed)) == [
        "step 0: 1 receipts chose a declared terminal, 2 rollouts declared one",
        "step 1: 1 receipts fail ({})",
    ]
