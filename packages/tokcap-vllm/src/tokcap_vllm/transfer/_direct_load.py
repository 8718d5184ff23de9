"""The direct load of a push into a CPU engine's model (the plan: `_direct_plan`).

`DirectLoader.plan` runs once per engine (the push's names do not change): the model's own
``load_weights`` over the staged tensors, with every parameter swapped for a meta stand-in
whose ``weight_loader`` records the call (vLLM's name mapping, stacked shards and tied
heads decide, as in a real load; the stand-ins of a weight the CPU dispatch removed take
its shape from vLLM's reload metadata). The real parameters are back before it returns.
`DirectLoader.load` then, per push (the engine paused):

1. copies every other parameter in place with its own loader (norms, embedding, biases);
2. gives each packed layer its weight straight from the push: the staged view itself, the
   shards' views as one when they lie back to back in the push file, else one
   ``torch.cat`` into a buffer kept for the next push; then the layer's own
   ``quant_method.process_weights_after_loading`` packs it as a load would (the oneDNN
   handle copies it; the weight is removed again, so nothing keeps viewing the file; a
   weight the dispatch keeps is replaced by a copy), layers in a thread pool (`_pack`);
3. runs the quant method again on the layers whose parameters were copied (the embedding
   and a tied head sharing its weight: their packed copy of it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ._direct_plan import DirectPlan, LayerFacts, LoaderCall, NotDirect, plan_direct
from ._shm import joined
from ._spec import TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["DirectLoader", "LoadReport", "direct_refusal"]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one direct load did."""

    packed: int
    viewed: int
    """Packed layers whose weight was a view of the push file (no copy)."""
    joined: int
    """Packed layers whose shards were joined into a kept buffer (one copy)."""
    copied: int
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Copying, packing, processing the copied layers again."""

    def __str__(self) -> str:
        copy, pack, again = (f"{s * 1e3:.1f}" for s in self.seconds)
        return (
            f"direct load: {self.packed} packed layers ({self.viewed} from views of the file, "
            f"{self.joined} joined), {self.copied} tensors copied in place "
            f"(ms: copy {copy}, pack {pack}, reprocess {again})"
        )


def direct_refusal(model: Any, vllm_config: Any) -> str | None:
    """Why this engine cannot take a direct load at all, or None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not a CPU engine"
    if current_platform.is_zen_cpu():  # zentorch may keep viewing the weight it packs
        return "a zentorch CPU"
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        return "tensor or pipeline parallel"
    if vllm_config.quant_config is not None:
        return f"quantized ({type(vllm_config.quant_config).__name__})"
    if getattr(model, "_do_torchao_reload", False):
        return "torchao reload"
    return None


class DirectLoader:
    """Plans once, then loads push after push into ``model`` (one engine's worker)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._plan: DirectPlan | NotDirect | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def plan(
        self,
        staged: Mapping[str, torch.Tensor],
        push: Mapping[str, TensorSpec],
        tied: tuple[tuple[str, str], ...],
    ) -> DirectPlan:
        """The plan for pushes of ``push`` (made from the first one); `NotDirect` if none."""
        if self._plan is None:
            try:
                calls = record_calls(self.model, staged)
                self._plan = plan_direct(calls, layer_facts(self.model, calls), push, tied)
            except NotDirect as e:
                self._plan = e
            except Exception as e:  # the model's own loading refused the stand-ins
                self._plan = NotDirect(f"recording the model's loaders failed: {e!r}")
        if isinstance(self._plan, NotDirect):
            raise self._plan
        return self._plan

    def load(self, plan: DirectPlan, staged: Mapping[str, torch.Tensor]) -> LoadReport:
        """Apply ``plan`` to the staged tensors (steps 1-3 of the module)."""
        import torch
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        modules = dict(self.model.named_modules())
        marks = [time.perf_counter()]
        for call in plan.copied:
            param = getattr(modules[call.layer], call.param)
            loader = getattr(param, "weight_loader", default_weight_loader)
            assert call.source is not None  # the plan has no other
            loader(param, staged[call.source], *call.args, **dict(call.kwargs))
        marks.append(time.perf_counter())
        weights = []
        viewed = joins = 0
        for packed in plan.packed:
            parts = [staged[source] for source in packed.sources]
            weight = parts[0] if len(parts) == 1 else joined(parts)
            if weight is None:
                weight = self._join(packed.layer, parts, plan.joined_rows[packed.layer])
                joins += 1
            else:
                viewed += 1
            weights.append((modules[packed.layer], weight))
        threads = torch.get_num_threads()
        try:
            workers = max(1, min(threads, len(weights)))
            with ThreadPoolExecutor(workers, initializer=_one_thread) as pool:
                list(pool.map(_pack, weights))  # re-raises the first failure
        finally:  # torch keeps the last count for threads started later: the engine's again
            torch.set_num_threads(threads)
        marks.append(time.perf_counter())
        for name in plan.reprocess:
            modules[name].quant_method.process_weights_after_loading(modules[name])
        marks.append(time.perf_counter())
        seconds = (marks[1] - marks[0], marks[2] - marks[1], marks[3] - marks[2])
        return LoadReport(len(plan.packed), viewed, joins, len(plan.copied), seconds)

    def _join(self, layer: str, parts: list[torch.Tensor], rows: int) -> torch.Tensor:
        import torch

        shape = (rows, *parts[0].shape[1:])
        buffer = self._buffers.get(layer)
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != parts[0].dtype:
            buffer = self._buffers[layer] = torch.empty(shape, dtype=parts[0].dtype)
        return torch.cat(parts, out=buffer)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _pack(item: tuple[Any, torch.Tensor]) -> None:
    """Give a packed layer its new weight and let its quant method pack it.

    Run in a pool, one layer per thread and one OpenMP thread each: oneDNN's reorder of one
    layer over several threads cost 3-4x more than on one (measured, 2-core host, 64
    layers of a ~100M model: 0.50 s vs 0.14 s), and layers are independent.
    """
    import torch

    layer, weight = item
    emptied = layer.weight
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    try:
        layer.quant_method.process_weights_after_loading(layer)
    except BaseException:  # back to the emptied weight the layerwise reload expects
        layer.weight = emptied
        raise
    if layer.weight.numel():  # the dispatch kept it: it must not view the file
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()


def record_calls(model: Any, staged: Mapping[str, torch.Tensor]) -> list[LoaderCall]:
    """The weight-loader calls ``model.load_weights(staged)`` makes, none of them run."""
    names = {id(tensor): name for name, tensor in staged.items()}
    calls: list[LoaderCall] = []

    def recorder(layer: str, param: str) -> Any:
        def record(_param: Any, loaded: Any, *args: Any, **kwargs: Any) -> None:
            source = names.get(id(loaded))
            calls.append(LoaderCall(layer, param, source, args, tuple(kwargs.items())))

        return record

    with _stand_ins(model, recorder):
        model.load_weights(iter(staged.items()))
    return calls


@contextlib.contextmanager
def _stand_ins(model: Any, recorder: Any) -> Iterator[None]:
    """Every parameter of ``model`` swapped for a meta stand-in with a recording loader
    (one stand-in per parameter object, so tied parameters stay tied), then put back."""
    import torch

    stand_ins: dict[int, torch.nn.Parameter] = {}
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for qualname, module in model.named_modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                stand_in = stand_ins.get(id(param))
                if stand_in is None:
                    meta = _reload_metadata(module, name)
                    shape = param.shape if meta is None else meta.shape
                    empty = torch.empty(shape, dtype=param.dtype, device="meta")
                    stand_in = torch.nn.Parameter(empty, requires_grad=False)
                    stand_in.weight_loader = recorder(qualname, name)  # type: ignore[attr-defined]
                    stand_ins[id(param)] = stand_in
                swapped.append((module, name, param))
                module._parameters[name] = stand_in
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def _reload_metadata(module: Any, name: str) -> Any:
    """The meta tensor vLLM recorded for ``module.name`` before processing (None if none)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    return None if info is None else info.restore_metadata[0].get(name)


def layer_facts(model: Any, calls: list[LoaderCall]) -> dict[str, LayerFacts]:
    """`LayerFacts` of every module the calls load into, and of the modules sharing their
    parameters."""
    modules = dict(model.named_modules())
    owners: dict[int, list[str]] = {}
    for qualname, module in modules.items():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(qualname)
    wanted = {call.layer for call in calls}
    sharers: dict[str, set[str]] = {name: set() for name in wanted}
    for names in owners.values():
        for name in names:
            if name in wanted:
                sharers[name].update(n for n in names if n != name)
    facts = {name: _facts(modules[name], tuple(sorted(sharers[name]))) for name in wanted}
    for name in set().union(*sharers.values()) - wanted:
        facts[name] = _facts(modules[name], ())
    return facts


def _facts(module: Any, sharers: tuple[str, ...]) -> LayerFacts:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.linear import (
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    method = getattr(module, "quant_method", None)
    sizes = cast("list[int]", getattr(module, "output_sizes", []))
    common: dict[str, Any] = {
        "method": None if method is None else type(method).__name__,
        "tp_size": int(getattr(module, "tp_size", 1)),
        "deferred": bool(is_deferred_attention_layer(module)),
        "sharers": sharers,
    }
    weight = module._parameters.get("weight")
    meta = _reload_metadata(module, "weight")
    if not isinstance(module, LinearBase) or weight is None or meta is None:
        return LayerFacts(**common)
    if isinstance(module, QKVParallelLinear):
        shard_ids: tuple[str | int | None, ...] = ("q", "k", "v")
    elif isinstance(module, MergedColumnParallelLinear):
        shard_ids = tuple(range(len(sizes)))
    else:
        shard_ids = (None,)
    rows = tuple(sizes) if shard_ids != (None,) else (meta.shape[0],)
    plain = (
        meta.ndim == 2
        and getattr(meta, "output_dim", None) == 0
        and getattr(meta, "input_dim", None) == 1
        and getattr(meta, "packed_dim", None) is None
        and not getattr(meta, "is_sharded_weight", False)
        and sum(rows) == meta.shape[0]
    )
    return LayerFacts(
        **common,
        removed=weight.numel() == 0 and hasattr(module, "cpu_linear"),
        shard_ids=shard_ids,
        rows=rows,
        cols=int(meta.shape[1]) if meta.ndim == 2 else 0,
        dtype=str(meta.dtype).removeprefix("torch."),
        plain_layout=plain,
    )
