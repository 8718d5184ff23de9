"""What a push loads where, decided without touching an engine: the plan of a direct load.

A CPU engine packs every unquantized linear layer into a oneDNN handle and empties its
``.weight`` (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`); vLLM's
layerwise reload therefore rebuilds each layer in fresh tensors, loads, repacks and copies
back. A direct load skips the fresh tensors: a packed layer gets its weight straight from
the push (the tensor itself, or its shards joined in the layer's row order) and packs it
with its own quant method; every other parameter is copied in place by its own loader,
and the layers holding those parameters run their quant method again.

The engine side (`tokcap_vllm.transfer._direct_load`) learns what goes where by running the model's
own ``load_weights`` with recording loaders (vLLM's name mapping, stacked shards and tied
heads included) and describes the layers it touched (`LayerFacts`); `plan_direct` turns
that into a `DirectPlan`, or refuses with `NotDirect` naming the first thing it does not
recognise, and the push then goes through the layerwise reload, unchanged. Recognised:

- a packed layer: ``UnquantizedLinearMethod``, one tensor-parallel rank, weight laid out
  ``[out, in]``, loaded with exactly its shard ids (``q``/``k``/``v``, ``0..n-1``, or
  none), each shard of the layer's rows and columns, in its dtype;
- a copied parameter: any loader, on a layer with no quant method or an unquantized one;
- every pushed tensor loaded, but a tied head whose embedding is (the engine has one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ._spec import TensorSpec

__all__ = ["DirectPlan", "LayerFacts", "LoaderCall", "NotDirect", "Packed", "plan_direct"]

LINEAR: Final = "UnquantizedLinearMethod"
EMBEDDING: Final = "UnquantizedEmbeddingMethod"
_METHODS: Final = frozenset({None, LINEAR, EMBEDDING})

ShardId = str | int | None


class NotDirect(ValueError):
    """The push cannot be loaded directly; the message says why (it is logged)."""


@dataclass(frozen=True, slots=True)
class LoaderCall:
    """One call the model's ``load_weights`` made to a parameter's weight loader."""

    layer: str
    """The module owning the parameter (its first name, for a parameter two modules hold)."""
    param: str
    source: str | None
    """The pushed tensor it was handed; None when the model handed it something else."""
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class LayerFacts:
    """What the plan needs to know of one module."""

    method: str | None = None
    """Its quant method's class name; None without one."""
    removed: bool = False
    """A linear layer whose ``.weight`` the CPU dispatch emptied (a packed handle holds it)."""
    shard_ids: tuple[ShardId, ...] = ()
    """The shards of its weight in row order: ``("q", "k", "v")``, ``(0, 1)``, ``(None,)``."""
    rows: tuple[int, ...] = ()
    cols: int = 0
    dtype: str = ""
    plain_layout: bool = True
    """Its weight is ``[out, in]``, unpacked, unsharded (the layout a view of the push has)."""
    tp_size: int = 1
    deferred: bool = False
    """An attention-like layer that vLLM processes only once everything is loaded."""
    sharers: tuple[str, ...] = ()
    """Other modules holding one of its parameters (a tied head)."""


@dataclass(frozen=True, slots=True)
class Packed:
    """A packed layer's weight: these pushed tensors, joined along rows in this order."""

    layer: str
    sources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DirectPlan:
    """Copy ``copied`` with their loaders, pack ``packed``, run ``reprocess``'s quant methods."""

    packed: tuple[Packed, ...] = ()
    copied: tuple[LoaderCall, ...] = ()
    reprocess: tuple[str, ...] = ()
    joined_rows: Mapping[str, int] = field(default_factory=dict)
    """Rows of each multi-shard packed layer (for its join buffer)."""


def plan_direct(
    calls: Sequence[LoaderCall],
    layers: Mapping[str, LayerFacts],
    push: Mapping[str, TensorSpec],
    tied: Sequence[tuple[str, str]] = (),
) -> DirectPlan:
    """The direct load of ``push`` given the model's loader ``calls``; `NotDirect` if any
    part is not recognised (see the module)."""
    groups: dict[tuple[str, str], list[LoaderCall]] = {}
    for call in calls:
        where = f"{call.layer}.{call.param}"
        if call.source is None:
            raise NotDirect(f"{where}: the model hands its loader a tensor not in the push")
        facts = layers.get(call.layer)
        if facts is None:
            raise NotDirect(f"{where}: no facts on {call.layer}")
        if facts.method not in _METHODS:
            raise NotDirect(f"{call.layer}: quant method {facts.method}")
        if facts.tp_size != 1:
            raise NotDirect(f"{call.layer}: {facts.tp_size} tensor-parallel ranks")
        if facts.deferred:
            raise NotDirect(f"{call.layer}: an attention layer loads {call.source}")
        groups.setdefault((call.layer, call.param), []).append(call)
    packed, copied = [], []
    for (layer, param), group in groups.items():
        facts = layers[layer]
        if param == "weight" and facts.removed:
            packed.append(_packed(layer, group, facts, push))
        else:
            copied.extend(group)
    loaded = {call.source for call in calls}
    skipped = {head for head, embedding in tied if embedding in loaded}
    unloaded = sorted(push.keys() - loaded - skipped)
    if unloaded:
        raise NotDirect(f"the model loads no {unloaded[:3]} ({len(unloaded)} in all)")
    packed_layers = {p.layer for p in packed}
    reprocess: dict[str, None] = {}
    for call in copied:
        for name in (call.layer, *layers[call.layer].sharers):
            facts = layers.get(name)
            if facts is None:
                raise NotDirect(f"{name} holds {call.layer}.{call.param}; no facts on it")
            if facts.method not in _METHODS:
                raise NotDirect(f"{name}: quant method {facts.method}")
            if facts.method is not None and name not in packed_layers:
                reprocess[name] = None
    for p in packed:
        if layers[p.layer].sharers:
            raise NotDirect(f"{p.layer}: its packed weight is shared")
    joined_rows = {p.layer: sum(layers[p.layer].rows) for p in packed if len(p.sources) > 1}
    return DirectPlan(tuple(packed), tuple(copied), tuple(reprocess), joined_rows)


def _packed(
    layer: str, group: Sequence[LoaderCall], facts: LayerFacts, push: Mapping[str, TensorSpec]
) -> Packed:
    """The packed layer's sources in its shard order, if shards and shapes add up."""
    if not facts.plain_layout:
        raise NotDirect(f"{layer}: its weight is not a plain [out, in] matrix")
    if any(call.kwargs or len(call.args) > 1 for call in group):
        raise NotDirect(f"{layer}: its loader takes arguments besides a shard id")
    shards: dict[ShardId, str] = {}
    for call in group:
        shard = call.args[0] if call.args else None
        if shard in shards:
            raise NotDirect(f"{layer}: shard {shard!r} loaded twice")
        assert call.source is not None
        shards[shard] = call.source
    if set(shards) != set(facts.shard_ids) or len(facts.rows) != len(facts.shard_ids):
        raise NotDirect(f"{layer}: shards {list(shards)}, the layer has {list(facts.shard_ids)}")
    sources = tuple(shards[shard] for shard in facts.shard_ids)
    for source, rows in zip(sources, facts.rows, strict=True):
        dtype, shape = push[source]
        if (dtype, tuple(shape)) != (facts.dtype, (rows, facts.cols)):
            raise NotDirect(
                f"{layer}: {source} is {dtype}{list(shape)}, the layer takes "
                f"{facts.dtype}{[rows, facts.cols]}"
            )
    return Packed(layer, sources)
