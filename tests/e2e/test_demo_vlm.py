"""``tokcap demo --quick --model-family idefics3``: the tiny vision-language model, run as a
user runs it (one subprocess, real vLLM, TransferQueue and Ray). Each rollout sends a
picture with its task and one inside its first tool answer; the engine expands both, the
ledgers name their bytes, the rows carry the engine's ids exactly, and the report shows
every image the rows carry as a thumbnail over its tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._cli import tokcap

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo-vlm") / "run"
    proc = tokcap(
        "demo", "--quick", "--model-family", "idefics3", "--out", out, timeout=DEMO_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "Images (the engine's tokens, bound by their bytes)" in proc.stdout
    return out


@pytest.fixture(scope="module")
def summary(run: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((run / "summary.json").read_text())
    return loaded


def test_every_rollout_verified_with_its_images(summary: dict[str, Any]) -> None:
    assert summary["config"]["family"] == "idefics3"
    assert summary["rollouts"] == {"total": 8, "verified": 8, "poisoned": 0, "groups": 2}
    images = summary["images"]
    # a picture with the task, one in the first tool answer (the rewrite rollouts compact
    # their history before the second is sent: they send one)
    rewrites = summary["behaviours"]["rewrite"]["rollouts"]
    assert images["sent_in_verified_rollouts"] == 2 * 8 - rewrites
    assert images["named_by_their_ledgers"] == images["sent_in_verified_rollouts"]


def test_rows_hold_the_engines_expanded_ids(summary: dict[str, Any]) -> None:
    """Every row equals what the engine reported (its expanded prompt ids included); the
    rows that kept their history carry both pictures (the rewrite rollouts' rows, compacted
    to text, none), each expanded once: 33 tokens for a 48x48 picture."""
    parity, rows, images = summary["engine_parity"], summary["rows"], summary["images"]
    assert rows["verified"] == rows["valid"] == rows["total"] == 8
    assert parity["rows_differing"] == 0
    assert parity["rows_checked"] == 8
    rewrites = summary["behaviours"]["rewrite"]["rollouts"]
    assert images["in_valid_rows"] == 2 * (8 - rewrites)
    assert images["tokens_in_valid_rows"] == 33 * images["in_valid_rows"]


def test_retokenizing_text_would_have_drifted_at_the_first_image(summary: dict[str, Any]) -> None:
    """A text-based trainer renders one ``<image>`` per picture; the engine ran 34 tokens."""
    assert summary["drift"]["trajectories_drifted"] == summary["drift"]["trajectories_checked"]


def test_the_report_shows_each_image_over_its_tokens(run: Path, summary: dict[str, Any]) -> None:
    page = (run / "report.html").read_text()
    thumbs = re.findall(r'<img class="thumb" src="data:image/png;base64,[^"]+"', page)
    assert len(thumbs) == summary["images"]["in_valid_rows"]
    image_tokens = re.findall(r'class="t im[ "]', page)
    assert len(image_tokens) == summary["images"]["tokens_in_valid_rows"]
