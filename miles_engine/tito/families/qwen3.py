"""``qwen3``: ChatML with ``<think>`` reasoning and ``<tool_call>{json}</tool_call>`` tool calls.

Written for append-only rendering, unlike Qwen's shipped template, which drops the reasoning
of assistant turns before the last user message (so a new user message rewrites history).
Here an assistant message renders from itself alone: ``<think>\\n{reasoning}\\n</think>\\n\\n``
when it has ``reasoning_content`` (an empty string renders the empty block of a turn taken
with thinking off), then the content and the tool calls. Tool results are grouped into one
``user`` turn of ``<tool_response>`` blocks, as Qwen3 was trained.

Generation prompt: ``<|im_start|>assistant\\n``, plus ``<think>\\n\\n</think>\\n\\n`` when
``enable_thinking`` is false (request ``chat_template_kwargs``). Boundary merge: ChatML's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.tito.families.base import ParsedTurn
from miles_engine.tito.families.chatml import HERMES_CALLS, TOOLS_POSTAMBLE, TOOLS_PREAMBLE, ChatMLMerge
from miles_engine.tito.parsers import parse_hermes_tool_calls, split_reasoning

QWEN3_TEMPLATE = (
    r"""
{%- if tools %}
{{- '<|im_start|>system\n' + (messages[0].content + '\n\n' if messages[0].role == 'system' else '') }}
{{- "TOOLS_PREAMBLE" }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- "TOOLS_POSTAMBLE" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content is string %}
{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' + message.content.lstrip('\n') }}
{%- else %}
{{- message.content }}
{%- endif %}
HERMES_CALLS
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""
    .replace("TOOLS_PREAMBLE", TOOLS_PREAMBLE)
    .replace("TOOLS_POSTAMBLE", TOOLS_POSTAMBLE)
    .replace("HERMES_CALLS", HERMES_CALLS.strip("\n"))
)


class Qwen3Family(ChatMLMerge):
    name = "qwen3"
    template = QWEN3_TEMPLATE
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    required_tokens = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
    default_kwargs = {"enable_thinking": True}
    request_kwargs = ("enable_thinking",)
    has_reasoning = True

    def parse(self, text: str, *, kwargs: dict[str, Any], tools: Sequence[dict[str, Any]],
              parse_tools: bool) -> ParsedTurn:
        reasoning, content = split_reasoning(text, prompt_closed=not self.thinking(kwargs))
        found = parse_hermes_tool_calls(content) if parse_tools else None
        if found is None:
            return ParsedTurn(content=content, reasoning=reasoning)
        return ParsedTurn(content=found[0], reasoning=reasoning, calls=found[1])
