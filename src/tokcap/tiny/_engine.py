"""How vLLM serves the tiny Qwen model: the CPU engine's options and its tool-calling template.

`ENGINE_ARGS` are the CPU engine's options for every tiny model (`tokcap demo`, `tokcap
train`, the tests' gates); `QWEN_VLLM_ARGS` add the tiny Qwen model's tool calls (vLLM's
``hermes`` parser, `CHATML_TOOLS_TEMPLATE` as ``--chat-template``). The tiny Mistral model's
are `mistral_vllm_args`.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CHATML_TOOLS_TEMPLATE", "ENGINE_ARGS", "QWEN_VLLM_ARGS", "chatml_tool_args"]

ENGINE_ARGS: Final = (
    "--enforce-eager",
    "--distributed-executor-backend", "uni",
    "--max-model-len", "4096",
    "--dtype", "float32",
    "--disable-log-stats",
    "--max-num-seqs", "64",
    # vLLM 0.32 CPU: a seeded request whose prefill is chunked kills the engine core
    "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192",
    "--no-use-tqdm-on-load",
)  # fmt: skip
"""The CPU engine's options, the same for every tiny model (and model family of `tokcap demo`)."""


_TOOLS_SYSTEM = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
)
"""The tool list and calling instructions that close the system turn when tools are given."""

_TOOL_CALLS = (
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)
"""An assistant message's calls, each one ``<tool_call>`` JSON object."""

_TOOL_GROUP_OPEN = (
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
)
_TOOL_GROUP_CLOSE = (
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)
_END = (
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    + _TOOLS_SYSTEM
    + "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and not message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    + _TOOL_CALLS
    + "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    + _TOOL_GROUP_OPEN
    + "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    + _TOOL_GROUP_CLOSE
    + "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}" + _END
)
"""The tiny Qwen model's tool-calling chat template: Qwen2.5-style ChatML with tools (the
tool list in the system turn, each call as one ``<tool_call>`` JSON object with arguments
re-serialised by ``tojson``, consecutive tool results grouped in one user turn as
``<tool_response>`` blocks). vLLM serves it as ``--chat-template``; the tokenizer keeps
`CHATML_TEMPLATE`."""


_PARTS = (
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{- '<image>' }}{%- endif %}"
)


def _content(message: str) -> str:
    """Jinja that writes ``message``'s content: a string as is, a list of parts part by part
    (text as is, each image one ``<image>``). Inline loops, so that vLLM reads the template
    as taking OpenAI-style content lists."""
    return (
        f"{{%- if {message}['content'] is none %}}"
        f"{{%- elif {message}['content'] is string %}}{{{{- {message}['content'] }}}}"
        f"{{%- else %}}{{%- for part in {message}['content'] %}}{_PARTS}{{%- endfor %}}"
        "{%- endif %}"
    )


CHATML_TOOLS_IMAGES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}" + _content("messages[0]") + "{{- '\\n\\n' }}"
    "{%- endif %}" + _TOOLS_SYSTEM + "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' }}" + _content("messages[0]") + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.get('tool_calls') %}"
    "{%- if message['content'] is string and message['content'] or message['content'] is not "
    "string and message['content'] and (message['content'] | map(attribute='text', default='')"
    " | join or message['content'] | selectattr('type', 'equalto', 'image') | list) %}"
    "{{- '\\n' }}"
    + _content("message")
    + "{%- endif %}"
    + _TOOL_CALLS
    + "{%- else %}{{- '\\n' }}"
    + _content("message")
    + "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    + _TOOL_GROUP_OPEN
    + "{{- '\\n<tool_response>\\n' }}"
    + _content("message")
    + "{{- '\\n</tool_response>' }}"
    + _TOOL_GROUP_CLOSE
    + "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    + _content("message")
    + "{{- '<|im_end|>\\n' }}"
    + _END
)
"""`CHATML_TOOLS_TEMPLATE` for a model that takes images (the tiny VLM of `tokcap demo
--model-family idefics3`): it renders the same text, but any message's content may be a
list of parts (vLLM hands a template that iterates parts every content as a list), each
image one ``<image>`` that the engine expands (an image inside a tool result sits in its
``<tool_response>`` block)."""


def chatml_tool_args(template: str) -> tuple[str, ...]:
    """vLLM options for the tiny Qwen model's tool calls: ``hermes`` parser, ``template``."""
    return (
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--chat-template", template,
    )  # fmt: skip


QWEN_VLLM_ARGS: Final = (*ENGINE_ARGS, *chatml_tool_args(CHATML_TOOLS_TEMPLATE))
"""The tiny Qwen model's engine options: `tokcap demo`'s default (``qwen``) family and `tokcap
train`."""
