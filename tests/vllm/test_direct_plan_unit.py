"""The direct load's plan (engine-free): what goes where, shard order, and every refusal that
sends a push back to vLLM's layerwise reload; the push file's views joined without a copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokcap_vllm.transfer._direct_plan import (
    EMBEDDING,
    LINEAR,
    DirectPlan,
    LayerFacts,
    LoaderCall,
    NotDirect,
    Packed,
    plan_direct,
)
from tokcap_vllm.transfer._shm import KeptBuffers, PushFile, joined, read_push_file, write_push_file

QKV = "model.layers.0.self_attn.qkv_proj"
OPROJ = "model.layers.0.self_attn.o_proj"
NORM = "model.layers.0.input_layernorm"
EMBED = "model.embed_tokens"
HEAD = "lm_head"
P = "model.layers.0.self_attn."


def push() -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        P + "q_proj.weight": ("float32", (8, 4)),
        P + "k_proj.weight": ("float32", (2, 4)),
        P + "v_proj.weight": ("float32", (2, 4)),
        P + "o_proj.weight": ("float32", (4, 8)),
        NORM + ".weight": ("float32", (4,)),
        EMBED + ".weight": ("float32", (16, 4)),
        HEAD + ".weight": ("float32", (16, 4)),
    }


def calls() -> list[LoaderCall]:
    """What Qwen3's load_weights calls, in checkpoint order (v before q: order is free)."""
    return [
        LoaderCall(QKV, "weight", P + "v_proj.weight", ("v",)),
        LoaderCall(QKV, "weight", P + "q_proj.weight", ("q",)),
        LoaderCall(QKV, "weight", P + "k_proj.weight", ("k",)),
        LoaderCall(OPROJ, "weight", P + "o_proj.weight"),
        LoaderCall(NORM, "weight", NORM + ".weight"),
        LoaderCall(EMBED, "weight", EMBED + ".weight"),
    ]


def layers() -> dict[str, LayerFacts]:
    linear = {"method": LINEAR, "removed": True, "dtype": "float32"}
    return {
        QKV: LayerFacts(**linear, shard_ids=("q", "k", "v"), rows=(8, 2, 2), cols=4),
        OPROJ: LayerFacts(**linear, shard_ids=(None,), rows=(4,), cols=8),
        NORM: LayerFacts(),
        EMBED: LayerFacts(method=EMBEDDING, sharers=(HEAD,)),
        HEAD: LayerFacts(method=EMBEDDING, sharers=(EMBED,)),
    }


TIED = ((HEAD + ".weight", EMBED + ".weight"),)


def test_a_qwen_push_packs_the_linears_in_shard_order_and_copies_the_rest() -> None:
    plan = plan_direct(calls(), layers(), push(), TIED)
    qkv = tuple(P + f"{x}_proj.weight" for x in "qkv")
    assert plan.packed == (Packed(QKV, qkv), Packed(OPROJ, (P + "o_proj.weight",)))
    assert [(c.layer, c.source) for c in plan.copied] == [
        (NORM, NORM + ".weight"),
        (EMBED, EMBED + ".weight"),
    ]
    assert plan.reprocess == (EMBED, HEAD)  # the tied head packs its own copy again
    assert plan.joined_rows == {QKV: 12}


def test_merged_shards_go_in_index_order() -> None:
    gate_up = "model.layers.0.mlp.gate_up_proj"
    facts = {gate_up: LayerFacts(LINEAR, True, (0, 1), (6, 6), 4, "float32")}
    spec = {"up": ("float32", (6, 4)), "gate": ("float32", (6, 4))}
    plan = plan_direct(
        [LoaderCall(gate_up, "weight", "up", (1,)), LoaderCall(gate_up, "weight", "gate", (0,))],
        facts,
        spec,
    )
    assert plan == DirectPlan((Packed(gate_up, ("gate", "up")),), (), (), {gate_up: 12})


def test_a_bias_on_a_packed_layer_is_copied_and_the_layer_is_not_packed_twice() -> None:
    found = [*calls(), LoaderCall(QKV, "bias", NORM + ".weight", ("q",))]
    plan = plan_direct(found, layers(), push(), TIED)
    assert LoaderCall(QKV, "bias", NORM + ".weight", ("q",)) in plan.copied
    assert QKV not in plan.reprocess  # packing it runs its quant method, once


def _edit(edit: str) -> tuple[list[LoaderCall], dict[str, LayerFacts], dict[str, object]]:
    found, facts, spec = calls(), layers(), dict(push())
    if edit == "transformed":
        found[3] = LoaderCall(OPROJ, "weight", None)
    elif edit == "quantized":
        facts[OPROJ] = LayerFacts("Fp8LinearMethod", True, (None,), (4,), 8, "float32")
    elif edit == "tp":
        facts[OPROJ] = LayerFacts(LINEAR, True, (None,), (4,), 8, "float32", tp_size=2)
    elif edit == "attention":
        facts[NORM] = LayerFacts(deferred=True)
    elif edit == "fused on disk":
        found[:3] = [LoaderCall(QKV, "weight", P + "q_proj.weight")]
    elif edit == "shard twice":
        found[2] = LoaderCall(QKV, "weight", P + "k_proj.weight", ("q",))
    elif edit == "shape":
        facts[QKV] = LayerFacts(LINEAR, True, ("q", "k", "v"), (8, 4, 4), 4, "float32")
    elif edit == "dtype":
        facts[OPROJ] = LayerFacts(LINEAR, True, (None,), (4,), 8, "bfloat16")
    elif edit == "layout":
        facts[OPROJ] = LayerFacts(LINEAR, True, (None,), (4,), 8, "float32", plain_layout=False)
    elif edit == "extra argument":
        found[3] = LoaderCall(OPROJ, "weight", P + "o_proj.weight", (), (("use_presharded", True),))
    elif edit == "unloaded":
        del found[4]
    elif edit == "untied head":
        del found[5]
    elif edit == "shared packed weight":
        facts[OPROJ] = LayerFacts(LINEAR, True, (None,), (4,), 8, "float32", sharers=(QKV,))
    elif edit == "quantized sharer":
        facts[HEAD] = LayerFacts(method="GGUFEmbeddingMethod")
    return found, facts, spec


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ("transformed", "not in the push"),
        ("quantized", "quant method Fp8LinearMethod"),
        ("tp", "2 tensor-parallel ranks"),
        ("attention", "an attention layer loads"),
        ("fused on disk", r"shards \[None\], the layer has \['q', 'k', 'v'\]"),
        ("shard twice", "shard 'q' loaded twice"),
        ("shape", r"k_proj.weight is float32\[2, 4\], the layer takes float32\[4, 4\]"),
        ("dtype", "the layer takes bfloat16"),
        ("layout", r"not a plain \[out, in\] matrix"),
        ("extra argument", "arguments besides a shard id"),
        ("unloaded", r"loads no \['model.layers.0.input_layernorm.weight'\]"),
        ("untied head", "loads no"),
        ("shared packed weight", "packed weight is shared"),
        ("quantized sharer", "quant method GGUFEmbeddingMethod"),
    ],
)
def test_what_the_plan_does_not_recognise_is_refused_with_its_reason(
    edit: str, reason: str
) -> None:
    found, facts, spec = _edit(edit)
    with pytest.raises(NotDirect, match=reason):
        plan_direct(found, facts, spec, TIED)  # type: ignore[arg-type]


def test_shards_back_to_back_in_the_push_file_join_as_a_view(tmp_path: Path) -> None:
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)  # 64-byte multiples
    norm = torch.randn(3)  # 12 bytes: the next tensor starts after padding
    tensors = [("q", q), ("k", k), ("v", v), ("n", norm), ("o", torch.randn(4, 4))]
    spec = {name: ("float32", tuple(t.shape)) for name, t in tensors}
    path, entries = write_push_file(tensors, str(tmp_path))
    views, buffer = read_push_file(path, entries, spec)
    staged = dict(views)
    qkv = joined([staged["q"], staged["k"], staged["v"]])
    assert qkv is not None
    assert torch.equal(qkv, torch.cat([q, k, v]))
    assert qkv.data_ptr() == staged["q"].data_ptr()  # no copy
    assert joined([staged["q"], staged["v"]]) is None  # not adjacent
    assert joined([staged["k"], staged["q"]]) is None  # out of order
    assert joined([staged["n"], staged["o"]]) is None  # padding between them
    assert joined([staged["v"], torch.randn(4, 4)]) is None  # another storage
    assert buffer is not None


def test_a_trainers_push_file_is_read_into_one_buffer_push_after_push(tmp_path: Path) -> None:
    spec = {"a": ("float32", (3, 5))}
    push = PushFile(str(tmp_path))
    path, entries = push.write([("a", torch.zeros(3, 5))])
    _, first = read_push_file(path, entries, spec)
    assert first is not None
    push.write([("a", torch.ones(3, 5))])
    views, again = read_push_file(path, entries, spec, previous=first)
    assert again is not None
    assert again.base is first.base  # same size: the same pages
    assert torch.equal(dict(views)["a"], torch.ones(3, 5))  # the rewrite, not a stale copy
    push.write([("a", torch.ones(3, 5)), ("b", torch.ones(2))])  # resized
    both = [["a", "float32", [3, 5], 0, 60], ["b", "float32", [2], 64, 8]]
    _, resized = read_push_file(path, both, {**spec, "b": ("float32", (2,))}, previous=first)
    assert resized is not None
    assert resized.base is not first.base
    push.remove()


def test_trainers_files_keep_their_buffers_between_pushes_and_removed_ones_are_let_go(
    tmp_path: Path,
) -> None:
    spec = {"a": ("float32", (3, 5))}
    kept = KeptBuffers(limit=2)
    one, fleet = PushFile(str(tmp_path)), PushFile(str(tmp_path))
    one_path, entries = one.write([("a", torch.zeros(3, 5))])
    fleet_path, _ = fleet.write([("a", torch.ones(3, 5))])
    first = kept.read(one_path, entries, spec)[0][0][1]
    kept.read(fleet_path, entries, spec)
    one.write([("a", torch.full((3, 5), 3.0))])
    again = kept.read(one_path, entries, spec)[0][0][1]  # the two files alternate: both kept
    assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert torch.equal(again, torch.full((3, 5), 3.0))
    assert len(kept) == 2
    upload, upload_entries = write_push_file([("a", torch.ones(3, 5))], str(tmp_path))
    kept.read(upload, upload_entries, spec)  # a gate's upload: removed after its push
    assert len(kept) == 2
    fleet.remove()
    kept.read(one_path, entries, spec)  # the removed file's buffer is let go
    assert len(kept) == 1
    kept.clear()
    one.remove()


class _Packing:
    """A stand-in quant method (no CPU GEMM here to pack with): keeps a copy and empties the
    weight as vLLM's dispatch does, keeps the weight as its torch fallback does, or fails."""

    def __init__(self, how: str) -> None:
        self.how = how

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.how == "fail":
            raise RuntimeError("no handle")
        layer.packed = layer.weight.detach().clone()
        if self.how == "empty":
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def _toy(*hows: str) -> torch.nn.Module:
    model = torch.nn.Module()
    for i, how in enumerate(hows):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        layer.quant_method = _Packing(how)
        model.add_module(f"l{i}", layer)
    return model


def test_a_direct_load_packs_views_and_keeps_no_view_of_the_push_file(tmp_path: Path) -> None:
    from tokcap_vllm.transfer._direct_load import DirectLoader

    q, k, w = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    tensors = [("q", q), ("k", k), ("w", w)]
    spec = {name: ("float32", tuple(t.shape)) for name, t in tensors}
    views, _ = read_push_file(*write_push_file(tensors, str(tmp_path)), spec)
    model = _toy("empty", "keep")
    plan = DirectPlan((Packed("l0", ("q", "k")), Packed("l1", ("w",))), joined_rows={"l0": 12})
    report = DirectLoader(model).load(plan, dict(views))
    assert (report.packed, report.viewed, report.joined) == (2, 2, 0)
    assert torch.equal(model.l0.packed, torch.cat([q, k]))
    assert model.l0.weight.numel() == 0
    assert torch.equal(model.l1.weight, w)  # a kept weight is the layer's own copy
    assert model.l1.weight.untyped_storage().data_ptr() != dict(views)["w"].data_ptr()


def test_a_layer_whose_packing_fails_gets_its_emptied_weight_back(tmp_path: Path) -> None:
    from tokcap_vllm.transfer._direct_load import DirectLoader

    tensors = [("a", torch.randn(4, 4)), ("b", torch.randn(4, 4))]
    spec = {name: ("float32", tuple(t.shape)) for name, t in tensors}
    views, _ = read_push_file(*write_push_file(tensors, str(tmp_path)), spec)
    model = _toy("empty", "fail")
    emptied = model.l1.weight
    plan = DirectPlan((Packed("l0", ("a",)), Packed("l1", ("b",))))
    with pytest.raises(RuntimeError, match="no handle"):
        DirectLoader(model).load(plan, dict(views))
    assert model.l1.weight is emptied  # what vLLM's layerwise reload, run next, expects
