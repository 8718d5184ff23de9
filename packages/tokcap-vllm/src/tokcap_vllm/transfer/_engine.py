"""tokcap's CPU transport as a vLLM weight-transfer engine: backend ``tokcap_shm``.

vLLM 0.32's weight transfer (`vllm.distributed.weight_transfer`) has a worker-side engine
and a trainer-side engine per backend; every shipped one (``nccl``, ``ipc``, ...) needs a
GPU. This module adds one for CPU engines, registered by the ``vllm.general_plugins``
entry point (`tokcap_vllm.server._plugin.register_weight_transfer`) and chosen with
``--weight-transfer-config '{"backend": "tokcap_shm"}'``. The bytes travel in a push file
(`tokcap_vllm.transfer._shm`) on the engine's host: written by the trainer into ``/dev/shm`` (same
host), or by the gate from a streamed HTTP body (another host); ``/update_weights`` carries
only ``{"path", "entries"}``.

Worker side (`TokcapShmWeightTransferEngine`), driven by vLLM's worker:

- ``start_weight_update``: drops anything an earlier, unfinished push staged. The model is
  not touched (no layerwise-reload set-up yet), so a push refused later changes nothing.
- ``update_weights``: checks the file (no link followed, a regular file of exactly the
  entries' size) and the entries against the engine's spec (names, dtypes, shapes, sizes;
  `_shm`, `_spec`), reads the file into a buffer of its own,
  refuses non-finite values (`_weights.refuse_non_finite`, on the bytes read:
  the bytes checked are the bytes loaded) and keeps the views aside. A trainer's push file
  (rewritten in place push after push) keeps its buffer for its next push
  (`tokcap_vllm.transfer._shm.KeptBuffers`). Overridden because the base calls
  ``torch.accelerator.synchronize()``, which raises on a CPU-only torch.
- ``finish_weight_update``: refuses (ValueError, nothing loaded) unless the staged set is
  exactly the spec (a partial push leaves a fused layer half-initialised: NaN, measured)
  and every file it was read from is unchanged since (``push_file_changed``: a file
  rewritten or shrunk under a push fails that push, never the engine).
  Then, on a CPU engine (one rank, unquantized), a **direct load**
  (`tokcap_vllm.transfer._direct_load`): each linear layer whose weight vLLM's CPU dispatch packed
  away takes its new weight straight from the push file (a view; a fused ``qkv_proj`` or
  ``gate_up_proj`` is one view when its shards lie back to back in the file, as a trainer's
  state dict writes them, else joined into a buffer kept across pushes) and is packed by
  its own quant method, as a load would; norms, the embedding and biases are copied in
  place by their own loaders, and the embedding (and a tied head) packs its copy again.
  What goes where comes from the model's own ``load_weights`` run once with recording
  loaders. Anything it does not recognise (a GPU, tensor or pipeline parallelism, a
  quantized or unknown quant method, shards or shapes that do not add up, a tensor the
  model transforms before loading; `tokcap_vllm.transfer._direct_plan`), or
  ``TOKCAP_SHM_LOAD=layerwise`` in the engine's environment, and the push goes through
  vLLM's layerwise reload (initialise, ``model.load_weights``, finalise), the path
  ``reload_weights(is_checkpoint_format=True)`` takes, unchanged; a direct load that fails
  part-way is followed by that reload, of every tensor. The worker logs one line per
  finish (``vllm.tokcap_shm``: which load, and why not the direct one).
  A finish with nothing staged loads nothing and succeeds: vLLM's worker leaves its
  update flag set when a finish raises (the next start then fails), and such an empty
  finish is how a client clears it.

Trainer side (`TokcapShmTrainerWeightTransferEngine`), for trainer code written against
vLLM's `WeightTransferTrainerFactory`: it writes the source into a push file and drives
start, update, finish through any `VLLMWeightSyncClient`. Pausing, the prefix-cache reset
and the gate's bearer token are the client's business (vLLM's own HTTP client sends no
headers): `tokcap_vllm.weights.GateWeightClient` does all three. A source must yield the
whole state dict (``StateDictSource``); vLLM's ``ModuleSource`` walks
``named_parameters()``, which omits a tied ``lm_head.weight``, and is refused.
Importing this module imports vLLM and torch::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    engine = WeightTransferTrainerFactory.trainer_init(
        TokcapShmTrainerInitInfo(rank=0),
        client=BearerWeightSyncClient(url, token),
        source=StateDictSource(model.state_dict()),
    )
    engine.send_weights()  # start, update, finish; pausing and the prefix-cache reset are
                           # yours (tokcap_vllm.weights.GateWeightClient does all of it)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ._direct_load import DirectLoader, direct_refusal
from ._direct_plan import NotDirect
from ._shm import (
    SHM_DIR,
    Entry,
    FileIdentity,
    KeptBuffers,
    unchanged_since,
    write_push_file,
)
from ._spec import TensorSpec, engine_spec
from ._weights import refuse_non_finite

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "BACKEND",
    "BearerWeightSyncClient",
    "StateDictSource",
    "TokcapShmInitInfo",
    "TokcapShmTrainerInitInfo",
    "TokcapShmTrainerWeightTransferEngine",
    "TokcapShmUpdateInfo",
    "TokcapShmWeightTransferEngine",
]

BACKEND = "tokcap_shm"
LOAD_ENV = "TOKCAP_SHM_LOAD"
"""``auto`` (the default: a direct load where recognised) or ``layerwise`` (always vLLM's
layerwise reload), read by each worker at start."""

# A vllm.* logger: the worker's line lands in the engine's log, at VLLM_LOGGING_LEVEL, as
# vLLM's own do (a tokcap_vllm.* logger has no handler in the engine core's process).
_log = logging.getLogger("vllm.tokcap_shm")


@dataclass
class TokcapShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the push file says everything."""


@dataclass
class TokcapShmUpdateInfo(WeightTransferUpdateInfo):
    """One ``/update_weights`` chunk: a push file on this host and what it holds."""

    path: str
    entries: list[Entry] = field(default_factory=list)


class TokcapShmWeightTransferEngine(WeightTransferEngine[TokcapShmInitInfo, TokcapShmUpdateInfo]):
    """Worker side of ``tokcap_shm``: stage views of push files, load them all at finish."""

    init_info_cls = TokcapShmInitInfo
    update_info_cls = TokcapShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._staged: dict[str, torch.Tensor] = {}
        self._spec: dict[str, TensorSpec] | None = None
        self._tied: tuple[tuple[str, str], ...] = ()
        self._buffers = KeptBuffers()
        self._read: dict[str, FileIdentity] = {}
        choice = os.environ.get(LOAD_ENV, "auto")
        if choice not in ("auto", "layerwise"):
            raise ValueError(f"{LOAD_ENV} is 'auto' or 'layerwise': {choice!r}")
        self._direct: DirectLoader | NotDirect | None = None
        if choice == "layerwise":
            self._direct = NotDirect(f"{LOAD_ENV}=layerwise")

    @property
    def spec(self) -> dict[str, TensorSpec]:
        """What a push carries, read once from the checkpoint the engine loaded."""
        if self._spec is None:
            self._spec, self._tied = engine_spec(self.model_config)
        return self._spec

    def init_transfer_engine(self, init_info: TokcapShmInitInfo) -> None:
        """Nothing to set up."""

    def start_weight_update(self) -> None:
        """Drop what an unfinished push staged; the model stays as it is."""
        self._staged, self._read = {}, {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Stage one chunk (no device synchronisation: there is no accelerator)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TokcapShmUpdateInfo) -> None:
        """Check the chunk's file and entries, read it, refuse non-finite values, keep the
        views (`WeightPushError`, a ValueError: nothing kept)."""
        tensors, identity = self._buffers.read(update_info.path, update_info.entries, self.spec)
        again = sorted(self._staged.keys() & {name for name, _ in tensors})
        if again:
            raise ValueError(f"tensors pushed twice: {again[:5]}")
        refuse_non_finite(tensors)
        self._staged.update(tensors)
        self._read[update_info.path] = identity

    def finish_weight_update(self) -> None:
        """Load the staged push if it is exactly the spec; see the module for an empty finish."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged, self._staged = self._staged, {}
        read, self._read = self._read, {}
        if not staged:
            return
        if staged.keys() != self.spec.keys():
            missing = sorted(self.spec.keys() - staged.keys())
            raise ValueError(f"a push carries every tensor; {len(missing)} missing: {missing[:5]}")
        for path, identity in read.items():
            unchanged_since(path, identity)
        started = time.perf_counter()
        how = self._load_directly(staged)
        if how is None:
            initialize_layerwise_reload(self.model)
            try:
                self.model.load_weights(iter(staged.items()))  # type: ignore[operator]
            finally:  # even after a failure: leave no layer waiting in the reload's state
                finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
            how = f"layerwise reload ({self._direct})"
        elapsed = (time.perf_counter() - started) * 1e3
        _log.info("tokcap_shm loaded %d tensors: %s, %.1f ms", len(staged), how, elapsed)

    def _load_directly(self, staged: dict[str, torch.Tensor]) -> str | None:
        """Load ``staged`` directly (`_direct_load`); None where the direct load
        does not apply (``self._direct`` then says why) or failed part-way (the layerwise
        reload then loads every tensor again)."""
        if self._direct is None or (
            isinstance(self._direct, DirectLoader) and self._direct.model is not self.model
        ):
            refusal = direct_refusal(self.model, self.vllm_config)
            self._direct = NotDirect(refusal) if refusal else DirectLoader(self.model)
        if isinstance(self._direct, NotDirect):
            return None
        try:
            plan = self._direct.plan(staged, self.spec, self._tied)
        except NotDirect as e:
            _log.warning("tokcap_shm: no direct load, vLLM's layerwise reload instead: %s", e)
            self._direct = e
            return None
        try:
            return str(self._direct.load(plan, staged))
        except Exception as e:
            _log.exception("tokcap_shm: the direct load failed; vLLM's layerwise reload instead")
            self._direct = NotDirect(f"the direct load failed: {e!r}")
            return None

    def shutdown(self) -> None:
        """Drop anything staged, and the kept buffers."""
        self._staged, self._read = {}, {}
        self._buffers.clear()


class StateDictSource(WeightSource):
    """A `WeightSource` over a full state dict (tied heads included), in its order."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights

    def metadata(self) -> list[ParamMeta]:
        """Name, dtype and shape of every tensor."""
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._weights.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights.items():
            yield name, tensor.detach().to("cpu").contiguous()


@dataclass
class TokcapShmTrainerInitInfo(TrainerInitInfo):
    """Trainer side of ``tokcap_shm``: where push files are written (the engine's host)."""

    backend: ClassVar[str] = BACKEND
    shm_dir: str = SHM_DIR


class TokcapShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[TokcapShmTrainerInitInfo]):
    """Trainer side of ``tokcap_shm``: one push file per round, start/update/finish via the
    client, the file removed afterwards (the worker's views keep what they need)."""

    init_info_cls = TokcapShmTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        shm_dir: str = SHM_DIR,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.shm_dir = shm_dir

    @classmethod
    def trainer_init(
        cls,
        init_info: TokcapShmTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """A ready engine; the sender tells the workers (nothing to agree on but the backend)."""
        if source is None:
            raise ValueError("tokcap_shm needs a WeightSource (StateDictSource of a state dict)")
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, shm_dir=init_info.shm_dir
        )
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        """Write the source into a push file and drive one full update round with it."""
        assert self.source is not None
        tensors = list(self.source)
        if not self.is_sender:
            return
        path, entries = write_push_file(tensors, self.shm_dir)
        try:
            self.client.start_weight_update()
            self.client.update_weights({"path": path, "entries": entries})
            self.client.finish_weight_update()
        finally:
            os.unlink(path)


class BearerWeightSyncClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client, sending the gate's bearer token (vLLM's sends none,
    and a gate answers 401 to its weight routes without it)."""

    def __init__(self, base_url: str, token: str, timeout: float = 300) -> None:
        super().__init__(base_url, timeout)
        self._headers = {"authorization": f"Bearer {token}"}

    def __repr__(self) -> str:
        return f"BearerWeightSyncClient({self.base_url!r})"

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        import httpx

        response = httpx.post(
            f"{self.base_url}/{path}", json=json, timeout=self.timeout, headers=self._headers
        )
        response.raise_for_status()
