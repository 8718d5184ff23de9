"""The planning room: what a rollout's calls returned, and the next prompt planned from it.

Everything here is pure but the renderers, which bind a request to the engine's tokenizer
and chat template. One module a job:

- `_index`: the parent index (`ParentIndex`), the one owner of what a rollout's calls
  returned; it learns an `Observed` call and plans the next one (`Planner`,
  `PlannedRequest`);
- `_plan_text`: fingerprints and parent resolution on rendered text (`ChatPlan`,
  `PriorCall`);
- `_plan_ids`: the same at the token level, for tokenizers that render straight to ids;
- `_splice`: forming a child's prompt on its parent's exact ids (extend, splice, break);
- `_render_text`, `_render_ids`: one request bound to the engine's tokenizer (text
  templates, vLLM's ``MistralTokenizer``), and `request_renderer`, which picks one.
"""

from ._index import Learned, Observed, ParentIndex, PlannedRequest, Planner
from ._plan_text import (
    ChatPlan,
    PriorCall,
)
from ._render_ids import IdRequestRenderer, request_renderer
from ._render_text import RequestRenderer
from ._splice import ON_RENDER_MISMATCH, REASONING_MODES

__all__ = [
    "ON_RENDER_MISMATCH",
    "REASONING_MODES",
    "ChatPlan",
    "IdRequestRenderer",
    "Learned",
    "Observed",
    "ParentIndex",
    "PlannedRequest",
    "Planner",
    "PriorCall",
    "RequestRenderer",
    "request_renderer",
]
