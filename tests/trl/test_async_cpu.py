"""The CPU replacements for TRL 1.16's ``AsyncGRPOTrainer`` (tests/trl/_async_cpu.py) are
exact: TRL's own tree packing (``TreeRow``: samples sharing a prefix forwarded once) run
through `CpuVarlenAttention` gives each sample's token logprobs as a plain forward of that
sample alone does. No engine: the tiny model on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trl._async_cpu import TRL_VERSION, CpuVarlenAttention, cpu_async_grpo


def _packing() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-import and vLLM-version notes
        from trl.experimental.async_grpo import packing

        return packing


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokcap.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "dense")


def test_the_replacements_are_pinned_to_one_trl_release() -> None:
    import trl

    assert trl.__version__ == TRL_VERSION
    packing = _packing()
    original = packing._flash_attn
    with cpu_async_grpo():
        assert packing._flash_attn() is CpuVarlenAttention
    assert packing._flash_attn is original


def test_tree_packed_logprobs_equal_a_plain_forward(model_dir: Path) -> None:
    import transformers

    packing = _packing()
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 2000, (12,), generator=generator)
    samples = [
        torch.cat([prefix, torch.randint(0, 2000, (5,), generator=generator)]),
        torch.cat([prefix, torch.randint(0, 2000, (8,), generator=generator)]),
        torch.randint(0, 2000, (9,), generator=generator),
    ]
    row = packing.TreeRow()
    for ids in samples:
        ones = torch.ones_like(ids)
        row.add(
            {
                "input_ids": ids,
                "completion_mask": ones,
                "old_log_probs": torch.zeros(len(ids)),
                "advantage": 0.0,
                "group_id": 0,
            }
        )
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(s) for s in samples)  # the prefix is shared

    with cpu_async_grpo():
        packing.register_tree_attention()
        tree = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=packing.TREE_ATTENTION
        )
        plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        calls = CpuVarlenAttention.calls
        with torch.no_grad():
            logits = tree(
                input_ids=packed["input_ids"][None],
                position_ids=packed["position_ids"][None],
                tree_kv_index=packed["tree_kv_index"],
                tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
            ).logits[0]
            expected = []
            for ids in samples:
                alone = torch.log_softmax(plain(input_ids=ids[None]).logits[0], -1)
                expected += [alone[p - 1, ids[p]] for p in range(1, len(ids))]
        assert CpuVarlenAttention.calls > calls

    logprobs = torch.log_softmax(logits, -1)
    # loss terms come sample by sample, in token order: term n of sample s targets ids[n + 1]
    seen = [0] * len(samples)
    got = []
    for index, s in zip(packed["token_index"].tolist(), packed["segment_id"].tolist(), strict=True):
        seen[s] += 1
        got.append(logprobs[index, samples[s][seen[s]]])
    assert len(got) == len(expected) == sum(len(s) - 1 for s in samples)
    assert torch.allclose(torch.stack(got), torch.stack(expected), atol=2e-6, rtol=0)
