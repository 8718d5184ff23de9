"""The worker side of a weight push: a vLLM worker extension.

Start the engine with ``--worker-extension-cls tokcap_vllm.WeightSyncWorker`` (or
``worker_extension_cls=`` in the engine args). vLLM appends the class to its worker's
bases, so these methods run on the worker, in the engine core's process, when
`tokcap_vllm.WeightSync` calls ``collective_rpc("tokcap_...")``. Tensors cannot ride an
RPC's arguments (they arrive as nested lists), so each comes as ``(name, dtype, shape,
bytes)``. A push is two phases:

1. ``tokcap_stage`` (any number of chunks, while the engine keeps generating): decode
   and check each tensor against the spec, keep it aside. The model is not touched.
   ``tokcap_stage_file`` does the same from a shared-memory file the server wrote (one
   RPC of metadata; the engine core must run on the same host).
2. ``tokcap_commit`` (generation paused): check the staged set is exactly the spec, then
   load it all in one ``reload_weights`` call, vLLM's in-place reload that re-runs each
   layer's post-load processing (CPU repacking included) once all its tensors arrived.

The staged copy costs one more model's worth of memory until the commit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._shm import check_push_file, open_push_file
from ._spec import TensorSpec, engine_spec

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSyncWorker"]

WireTensor = Sequence[Any]
"""``[name, dtype name, shape, bytes]`` as it arrives over vLLM's msgpack RPC."""


class _Staging:
    __slots__ = ("push_id", "tensors")

    def __init__(self, push_id: str) -> None:
        self.push_id = push_id
        self.tensors: dict[str, torch.Tensor] = {}


class WeightSyncWorker:
    """vLLM worker extension: ``tokcap_weight_spec``, ``tokcap_stage``, ``tokcap_stage_file``,
    ``tokcap_commit``, ``tokcap_discard``. Every name starts with ``tokcap_`` so none collides
    with the worker's.
    """

    def tokcap_weight_spec(self) -> dict[str, Any]:
        """The push contract, from the checkpoint the engine loaded: ``{"tensors": {name:
        [dtype, shape]}, "tied": [[head, embedding], ...]}``."""
        spec, tied = _spec_of(self)
        return {
            "tensors": {name: [dtype, list(shape)] for name, (dtype, shape) in spec.items()},
            "tied": [list(pair) for pair in tied],
        }

    def tokcap_stage(self, push_id: str, chunk: Sequence[WireTensor]) -> int:
        """Decode and check ``chunk`` for push ``push_id``; returns how many tensors are staged.

        A new ``push_id`` drops whatever an earlier, unfinished push staged.
        """
        import numpy

        staging = _staging_for(self, push_id)
        for name, dtype_name, shape, data in chunk:
            tensor = _checked_empty(self, push_id, name, dtype_name, shape, len(data))
            if tensor.nbytes:  # one copy; numpy reads the immutable bytes without a warning
                _bytes_of(tensor)[:] = numpy.frombuffer(data, numpy.uint8)
            staging.tensors[name] = tensor
        return len(staging.tensors)

    def tokcap_stage_file(self, push_id: str, path: str, entries: Sequence[Sequence[Any]]) -> int:
        """Like `tokcap_stage`, the bytes read from a shared-memory file the server wrote:
        ``entries`` are ``[name, dtype, shape, offset, nbytes]``. Same host only."""
        staging = _staging_for(self, push_id)
        spec, _ = _spec_of(self)
        check_push_file(path, entries, spec)  # no link, FIFO or device; exactly its size
        with os.fdopen(open_push_file(path), "rb") as f:
            for name, dtype_name, shape, offset, nbytes in entries:
                tensor = _checked_empty(self, push_id, name, dtype_name, shape, nbytes)
                f.seek(offset)
                if tensor.nbytes and f.readinto(_bytes_of(tensor)) != nbytes:
                    raise ValueError(f"tokcap push {push_id}: {path} ends inside {name}")
                staging.tensors[name] = tensor
        return len(staging.tensors)

    def tokcap_commit(self, push_id: str, count: int) -> int:
        """Load everything push ``push_id`` staged, if it is exactly the spec; returns the count.

        Refuses (ValueError, nothing loaded) a push it did not stage or an incomplete one.
        """
        staging = _staging(self)
        if staging is None or staging.push_id != push_id:
            raise ValueError(f"tokcap push {push_id} staged nothing here")
        spec, _ = _spec_of(self)
        if len(staging.tensors) != count or staging.tensors.keys() != spec.keys():
            missing = sorted(spec.keys() - staging.tensors.keys())
            raise ValueError(f"tokcap push {push_id} is incomplete: missing {missing[:5]}")
        self.__dict__["_tokcap_staging"] = None
        worker: Any = self
        worker.reload_weights(
            weights_iterator=iter(staging.tensors.items()), is_checkpoint_format=True
        )
        return count

    def tokcap_discard(self, push_id: str) -> bool:
        """Drop what push ``push_id`` staged (True if there was something)."""
        staging = _staging(self)
        if staging is None or staging.push_id != push_id:
            return False
        self.__dict__["_tokcap_staging"] = None
        return True


def _staging(worker: object) -> _Staging | None:
    staging: _Staging | None = worker.__dict__.get("_tokcap_staging")
    return staging


def _staging_for(worker: object, push_id: str) -> _Staging:
    """The staging of ``push_id``; a new push id drops an earlier push's."""
    staging = _staging(worker)
    if staging is None or staging.push_id != push_id:
        staging = _Staging(push_id)
        worker.__dict__["_tokcap_staging"] = staging
    return staging


def _checked_empty(
    worker: object, push_id: str, name: str, dtype_name: str, shape: Sequence[int], nbytes: int
) -> torch.Tensor:
    """An empty tensor for ``name``, if the spec expects it with this dtype, shape and size."""
    import torch

    spec, _ = _spec_of(worker)
    expected = spec.get(name)
    if expected is None:
        raise ValueError(f"tokcap push {push_id}: unknown tensor {name!r}")
    if (dtype_name, tuple(shape)) != expected:
        raise ValueError(
            f"tokcap push {push_id}: {name} is {dtype_name}{list(shape)}, "
            f"expected {expected[0]}{list(expected[1])}"
        )
    tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype_name))
    if nbytes != tensor.nbytes:
        raise ValueError(f"tokcap push {push_id}: {name} carries {nbytes} bytes")
    return tensor


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A writable numpy uint8 view of a contiguous tensor's memory."""
    import torch

    return tensor.view(-1).view(torch.uint8).numpy()


def _spec_of(worker: object) -> tuple[dict[str, TensorSpec], tuple[tuple[str, str], ...]]:
    """The spec and tied pairs, read once per worker from its config and checkpoint headers."""
    cached: tuple[dict[str, TensorSpec], tuple[tuple[str, str], ...]] | None
    cached = worker.__dict__.get("_tokcap_spec")
    if cached is None:
        engine_worker: Any = worker
        cached = engine_spec(engine_worker.vllm_config.model_config)
        worker.__dict__["_tokcap_spec"] = cached
    return cached
