"""The one place a server's tokenizer kind chooses how captured requests are planned."""

from __future__ import annotations

from typing import Any

from ._config import GateConfig
from ._render import RequestRenderer
from ._render_ids import IdRequestRenderer, is_id_tokenizer

__all__ = ["request_renderer"]


def request_renderer(
    tokenizer: Any, app_args: Any, config: GateConfig, max_model_len: int
) -> RequestRenderer:
    """The renderer for this server's tokenizer.

    Text chat templates get `RequestRenderer` (parent resolution and splicing on rendered
    text); a tokenizer that renders requests straight to ids (vLLM's ``MistralTokenizer``)
    gets the id-level planner (`IdRequestRenderer`), which raises `UnsupportedTokenizer`
    when follow-up turns cannot be planned with it.
    """
    if is_id_tokenizer(tokenizer):
        return IdRequestRenderer(tokenizer, app_args, config, max_model_len)
    return RequestRenderer(tokenizer, app_args, config, max_model_len)
