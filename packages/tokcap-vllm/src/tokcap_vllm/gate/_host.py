"""CaptureHost: the hook around vLLM's async engine that every OpenAI path funnels through.

vLLM's chat and completion handlers template the request, then call
``engine_client.generate(engine_input, sampling_params, request_id, ...)``. The host
replaces that bound method on the one engine instance. For a call the gate admitted (a
`Ticket` in the request's context) it swaps the prompt for the admitted token ids
(``token_in``), asks the engine for the sampled token's logprob (never shown to the
harness unless it asked: vLLM decides that from the request, not the sampling params; when
it did not ask, vLLM keeps them as flat lists, no per-token objects, and where
`install_logprob_text_switch` is active does not decode their tokens; prompt logprobs share
both, so a call that asks for those gets them as vLLM makes them) and accumulates output
ids, logprobs, finish reason, weight version and routed experts. A call with images runs
on vLLM's processed multimodal input bound to the admitted ids (`_media.MediaBinder`), and
its new images become media items of its result. When the
engine finishes, the ticket's ``on_finish`` runs *before* the final output is handed to vLLM's
response writer, so the sink write starts while the response is still being serialised.
Everything else passes through untouched.
"""

from __future__ import annotations

import contextvars
import functools
from array import array
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokcap_core import TokcapError
from tokcap_core.provenance import Spans, VersionSpan, single_span
from tokcap_core.routes import Routes, dtype_for_experts, routes_from_rows
from tokcap_core.staged import MediaItem

from ..errors import WeightPushError
from ..transfer import version_of_label
from ._logprob_text import SKIP_LOGPROB_TEXT, install_logprob_text_switch
from ._media import MediaBinder, MediaTicket
from ._vllm import require_vllm

__all__ = ["CURRENT_TICKET", "CaptureHost", "EngineResult", "Ticket", "cache_salt"]


@dataclass(slots=True)
class EngineResult:
    """What the engine saw and produced for one captured call."""

    prompt_ids: list[int]
    output_ids: array[int]
    logprobs: array[float]
    finish_reason: str | None
    weight_version: int
    """The engine's weight version at the first generated token."""
    weight_version_last: int
    """The version at the last generated token (differs when weights were pushed mid-call)."""
    text: str
    routes: Routes | None = None
    weight_versions: Spans = ()
    """Which weights sampled which output tokens (vLLM's spans, labels read as integers)."""
    salt_version: int = 0
    """The version the call's prompt was salted with (its prompt KV is of no older one)."""
    media: tuple[MediaItem, ...] | None = None
    """The items of the images this call's prompt added (None: the engine ran no images)."""
    media_blobs: dict[str, bytes] | None = None
    """The media blobs of those images by tensors digest (what the gate stages once)."""


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted call travelling with its HTTP request (via a context variable)."""

    prompt_ids: list[int]
    on_finish: Callable[[EngineResult], None]
    used: bool = False
    result: EngineResult | None = None
    salt_version: int | None = None
    """The weight version at admission: the prompt's ``cache_salt`` (``tokcap-w<version>``),
    so the prefix cache never hands the call blocks an older version computed."""
    structured_outputs: Any = None
    """Guided decoding the request's API has no field for (a tokcap extension), set on the
    engine call's sampling params; None leaves them as vLLM made them."""
    media: MediaTicket | None = None
    """The request's images (None: it has none)."""


def cache_salt(version: int) -> str:
    """The prefix-cache salt of calls admitted at ``version``."""
    return f"tokcap-w{version}"


CURRENT_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "tokcap_ticket", default=None
)


class CaptureHost:
    """Wraps one vLLM engine client's ``generate`` (install once; idempotent)."""

    def __init__(self, engine: Any, *, default_weight_version: int = 0) -> None:
        self.engine = engine
        self.default_weight_version = default_weight_version
        self._original = engine.generate
        self._route_dtype: str | None = None
        self.media = MediaBinder(engine)
        """Binds vLLM's processed images to admitted ids (`_media`)."""
        self.skips_logprob_text = False
        """Whether logprobs only the gate reads skip vLLM's per-token text (set by `install`)."""

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (the one vLLM's own renderer uses)."""
        return self.engine.tokenizer

    @functools.cached_property
    def seeded_prefill_chunks_crash(self) -> bool:
        """Whether a seeded request whose prefill gets chunked would kill this engine.

        vLLM's CPU model runner rewinds a request's random generator after a partial
        prefill chunk, which CPU generators refuse (``CPU Generator does not use offset``):
        the engine core dies, for every rollout. True on the CPU platform with chunked
        prefill enabled; the gate then refuses seeded captured calls (``seed_unsupported``)
        rather than let one harness take the server down.
        """
        config = getattr(self.engine, "vllm_config", None)
        scheduler = getattr(config, "scheduler_config", None)
        if scheduler is None or not getattr(scheduler, "enable_chunked_prefill", False):
            return False
        platforms = require_vllm("vllm.platforms")
        return bool(platforms.current_platform.is_cpu())

    def install(self) -> None:
        """Route every ``generate`` call on this engine through the host."""
        if getattr(self.engine, "_tokcap_host", None) is self:
            return
        if getattr(self.engine, "_tokcap_host", None) is not None:
            raise RuntimeError("another CaptureHost already wraps this engine")
        self.engine._tokcap_host = self
        self.engine.generate = self.generate
        self.skips_logprob_text = install_logprob_text_switch()

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        """The engine's ``generate``; captures when the caller's context holds an unused ticket."""
        ticket = CURRENT_TICKET.get()
        if ticket is None or ticket.used or not hasattr(sampling_params, "logprobs"):
            if isinstance(prompt, dict) and prompt.get("type") == "multimodal":
                self.media.observe(prompt)  # vLLM sends these tensors only once
            plain: AsyncGenerator[Any, None] = self._original(
                prompt, sampling_params, request_id, *args, **kwargs
            )
            return plain
        ticket.used = True
        return self._capture(ticket, prompt, sampling_params, request_id, args, kwargs)

    async def _capture(
        self,
        ticket: Ticket,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, None]:
        tokens_input = require_vllm("vllm.inputs").tokens_input
        RequestOutputKind = require_vllm("vllm.sampling_params").RequestOutputKind

        params = sampling_params.clone()
        if params.logprobs is None:  # the harness did not ask: only the gate reads them
            params.logprobs = 0
            # Prompt logprobs share the format and the tokenizer: leave them as asked.
            if params.prompt_logprobs is None:
                params.flat_logprobs = True
                if self.skips_logprob_text:
                    params.extra_args = {**(params.extra_args or {}), SKIP_LOGPROB_TEXT: True}
        if ticket.structured_outputs is not None:
            params.structured_outputs = ticket.structured_outputs
        delta = params.output_kind == RequestOutputKind.DELTA
        output_ids, logprobs, text = array("I"), array("f"), ""
        prompt_ids: Sequence[int] = ticket.prompt_ids
        salt = self.default_weight_version if ticket.salt_version is None else ticket.salt_version
        multimodal = isinstance(prompt, dict) and prompt.get("type") == "multimodal"
        media: tuple[MediaItem, ...] | None = None
        blobs: dict[str, bytes] | None = None
        if multimodal != (ticket.media is not None):
            raise TokcapError("media_mismatch", "the engine and the gate disagree on images")
        if ticket.media is not None:
            engine_input, media, blobs = self.media.bind(prompt, ticket.prompt_ids, ticket.media)
            engine_input["cache_salt"] = cache_salt(salt)
        else:
            engine_input = tokens_input(list(ticket.prompt_ids), cache_salt=cache_salt(salt))
        async for out in self._original(engine_input, params, request_id, *args, **kwargs):
            completion = out.outputs[0]
            if not delta:
                output_ids, logprobs, text = array("I"), array("f"), ""
            output_ids.extend(completion.token_ids)
            logprobs.extend(_sampled_logprobs(completion.token_ids, completion.logprobs))
            text += completion.text
            if out.prompt_token_ids is not None:  # the same list on every output: copy once
                prompt_ids = out.prompt_token_ids
            if out.finished:
                spans = _weight_spans(
                    completion.weight_versions, self.default_weight_version, len(output_ids)
                )
                first, last = (spans[0].version, spans[-1].version) if spans else (salt, salt)
                result = EngineResult(
                    prompt_ids=list(prompt_ids),
                    output_ids=output_ids,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    weight_version=first,
                    weight_version_last=last,
                    text=text,
                    routes=self._routes(completion.routed_experts),
                    weight_versions=spans,
                    salt_version=salt,
                    media=media,
                    media_blobs=blobs,
                )
                ticket.result = result
                ticket.on_finish(result)
            yield out

    def _routes(self, routed: Any) -> Routes | None:
        if routed is None:
            return None
        if self._route_dtype is None:
            self._route_dtype = dtype_for_experts(_num_experts(self.engine))
        return routes_from_rows(routed.tolist(), dtype=self._route_dtype)


def _sampled_logprobs(token_ids: Any, logprobs: Any) -> Sequence[float]:
    """The sampled token's logprob at each position (vLLM's sampler puts it first)."""
    if logprobs is None:
        raise RuntimeError("the engine returned no logprobs for a captured call")
    starts = getattr(logprobs, "start_indices", None)  # vLLM's FlatLogprobs
    if starts is not None:
        if len(starts) != len(token_ids):
            raise RuntimeError("the engine returned logprobs for a different number of tokens")
        values: Sequence[float]
        if len(logprobs.logprobs) == len(starts):  # logprobs=0: one entry per position
            sampled, values = logprobs.token_ids, logprobs.logprobs
        else:
            sampled = [logprobs.token_ids[i] for i in starts]
            values = [logprobs.logprobs[i] for i in starts]
        if sampled != list(token_ids):
            raise RuntimeError("the engine's logprobs name other tokens than it sampled")
        return values
    return [step[token].logprob for token, step in zip(token_ids, logprobs, strict=True)]


def _weight_spans(spans: Any, default: int, count: int) -> Spans:
    """vLLM's ``weight_versions`` as tokcap spans over ``count`` output tokens.

    vLLM reports contiguous spans over output tokens, in order; a push while a call
    generated (pause mode ``keep``) gives more than one. Labels that are not integer strings
    (vLLM's own ``"default"``) count as ``default``; neighbours that read as one version
    merge; none reported means ``default`` for every token.
    """
    out: list[VersionSpan] = []
    for span in spans or ():
        version, start, end = _version(span.version, default), int(span.start), int(span.end)
        if end <= start:
            continue
        if out and out[-1].version == version:
            out[-1] = VersionSpan(version=version, start=out[-1].start, end=end)
        else:
            out.append(VersionSpan(version=version, start=start, end=end))
    out = [s for s in out if s.start < count]
    if not out:
        return single_span(default, count) if count else ()
    # the spans tile exactly the tokens the call returned (a stop string trims the last)
    out[0] = VersionSpan(version=out[0].version, start=0, end=out[0].end)
    out[-1] = VersionSpan(version=out[-1].version, start=out[-1].start, end=count)
    return tuple(out)


def _version(label: Any, default: int) -> int:
    """The version a label spells (`version_of_label`); ``default`` for any other label."""
    try:
        return version_of_label(label)
    except WeightPushError:
        return default


def _num_experts(engine: Any) -> int:
    config = engine.model_config.hf_text_config
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise RuntimeError("routed experts returned by a model whose config names no expert count")
