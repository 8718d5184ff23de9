"""Skip the text of sampled-token logprobs that only the gate reads (a guarded vLLM patch).

A captured call whose harness did not ask for logprobs still needs the sampled token's
logprob, so `CaptureHost` asks the engine for ``logprobs=0``. vLLM's output processor then
decodes every logprob token to text (``convert_ids_list_to_tokens`` and a UTF-8 repair per
position, with the request's tokenizer): text nobody reads, since vLLM shows logprobs only
to a harness that asked (it decides from the request, not the sampling params) and the
gate reads ids and floats. vLLM has no switch for it: ``SamplingParams.detokenize=False``
also drops the response text and stop strings.

So, for the vLLM versions in `PATCHED_VERSIONS` only, the classmethod that builds each
request's ``LogprobsProcessor`` is wrapped: a request whose ``extra_args`` carry
`SKIP_LOGPROB_TEXT` gets a processor without a tokenizer, which is vLLM's own path for
detokenisation turned off (``decoded_token=None``); the request's text detokenizer keeps
the tokenizer. The processor decodes prompt logprobs with the same tokenizer, so a request
that asks for those is never marked. Every other request, and every other vLLM version, is
left as it was (correct, only slower).
"""

from __future__ import annotations

import inspect
from typing import Any, Final

from ._vllm import require_vllm

__all__ = ["PATCHED_VERSIONS", "SKIP_LOGPROB_TEXT", "install_logprob_text_switch"]

SKIP_LOGPROB_TEXT: Final = "tokcap_skip_logprob_text"
"""The ``SamplingParams.extra_args`` key that marks a request whose logprobs only tokcap reads."""
PATCHED_VERSIONS: Final = frozenset({"0.32.0"})
"""vLLM versions whose ``LogprobsProcessor`` was read and tested for this patch."""
_MARK: Final = "_tokcap_logprob_text_switch"


def install_logprob_text_switch() -> bool:
    """Wrap vLLM's ``LogprobsProcessor.from_new_request`` once; whether the switch is active."""
    try:
        vllm = require_vllm()
        LogprobsProcessor = require_vllm("vllm.v1.engine.logprobs").LogprobsProcessor
    except ImportError:
        return False
    if getattr(vllm, "__version__", None) not in PATCHED_VERSIONS:
        return False
    current = LogprobsProcessor.__dict__.get("from_new_request")
    if not isinstance(current, classmethod):
        return False
    if getattr(current.__func__, _MARK, False):
        return True
    original = current.__func__
    if list(inspect.signature(original).parameters) != ["cls", "tokenizer", "request"]:
        return False

    def from_new_request(cls: Any, tokenizer: Any, request: Any) -> Any:
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None)
        if extra and extra.get(SKIP_LOGPROB_TEXT):
            tokenizer = None
        return original(cls, tokenizer, request)

    setattr(from_new_request, _MARK, True)
    from_new_request.__doc__ = original.__doc__
    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    return True
