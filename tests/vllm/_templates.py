"""Chat templates of five model families, written from each family's documented behaviour.

They render for the tiny test tokenizer (ChatML specials, ``<|im_end|>`` as eos), so
family-specific control text that tokenizer lacks (``<|eot_id|>``, ``[INST]``) is plain
text there, exactly as a text template sees it. Requests pass them as ``chat_template``
(the session server trusts request templates).
"""

from __future__ import annotations

from typing import Final

from tokcap.demo import CHATML_TOOLS_TEMPLATE

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "FAMILIES",
    "GENERATION_TEMPLATE",
    "LLAMA3_TOOLS_TEMPLATE",
    "MISTRAL_TEMPLATE",
    "QWEN3_TEMPLATE",
]

# Qwen3: ChatML with tools (as Qwen2.5); a `<think>...</think>` block is split off the
# assistant content and kept only for turns after the last user query, so earlier turns
# lose their reasoning once the user speaks again.
QWEN3_TEMPLATE: Final = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if message['role'] == 'user' and ns.last_query < 0 %}"
    "{%- set ns.last_query = messages | length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}"
    "{%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and reasoning %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1: header blocks closed by `<|eot_id|>`, contents trimmed, tool results in the
# `ipython` role, tool calls as one JSON object `{"name": ..., "parameters": ...}`.
LLAMA3_TOOLS_TEMPLATE: Final = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": ' }}"
    "{{- call['function']['arguments'] | tojson + '}' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Mistral (v1, text): `[INST] ... [/INST]` around user turns (a system prompt joins the
# first one), the assistant's reply closed by the eos token, no generation prompt.
MISTRAL_TEMPLATE: Final = (
    "{{- bos_token or '' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'user' %}"
    "{%- if loop.index0 == 1 and messages[0]['role'] == 'system' %}"
    "{{- '[INST] ' + messages[0]['content'] + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)

# ChatML whose assistant turns sit in `{% generation %}` blocks (the markers transformers
# reads to build assistant masks); they render no text of their own.
GENERATION_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

FAMILIES: Final = {
    "chatml-tools (Qwen2.5)": CHATML_TOOLS_TEMPLATE,
    "qwen3 (strips earlier <think>)": QWEN3_TEMPLATE,
    "llama3 (<|eot_id|>, ipython)": LLAMA3_TOOLS_TEMPLATE,
    "mistral ([INST] text)": MISTRAL_TEMPLATE,
    "chatml {% generation %}": GENERATION_TEMPLATE,
}
"""Each family's template, by the name the report table uses."""
