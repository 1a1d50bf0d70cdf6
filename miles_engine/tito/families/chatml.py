"""``chatml``: plain ChatML (SmolLM2, tiny test models), Hermes-style tool calls, no reasoning.

Turn layout: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. The model stops on ``<|im_end|>``
and never samples the ``\\n`` after it: the boundary merge adds it (and closes the turn with
``<|im_end|>\\n`` when the model stopped on anything else, e.g. ``max_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.tito.families.base import ChatCodec, ChatFamily, ParsedTurn
from miles_engine.tito.parsers import parse_hermes_tool_calls

TOOLS_PREAMBLE = (
    r"""# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
    r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>"""
)
TOOLS_POSTAMBLE = (
    r"""\n</tools>\n\nFor each function call, return a json object with function name and arguments """
    r"""within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, """
    r"""\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"""
)
HERMES_CALLS = r"""
{%- for tc in message.tool_calls %}
{%- if not loop.first or message.content %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + tc.function.arguments + '}\n</tool_call>' }}
{%- endfor %}
"""

CHATML_TEMPLATE = (
    r"""
{%- set sys = messages[0].content if messages[0].role == 'system' else default_system %}
{%- if tools %}
{{- '<|im_start|>system\n' + (sys + '\n\n' if sys else '') }}
{{- "TOOLS_PREAMBLE" }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- "TOOLS_POSTAMBLE" }}
{%- elif sys %}
{{- '<|im_start|>system\n' + sys + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + message.content }}
HERMES_CALLS
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
    .replace("TOOLS_PREAMBLE", TOOLS_PREAMBLE)
    .replace("TOOLS_POSTAMBLE", TOOLS_POSTAMBLE)
    .replace("HERMES_CALLS", HERMES_CALLS.strip("\n"))
)


class ChatMLMerge(ChatFamily):
    """The ChatML boundary: re-add the newline after ``<|im_end|>``."""

    end_token = "<|im_end|>"

    def merge(self, codec: ChatCodec, last_id: int | None, suffix: list[int]) -> tuple[list[int], list[int]]:
        if last_id is None:
            return [], suffix
        end_id = codec.tokenizer.added_tokens[self.end_token]
        newline = codec.constant_ids("\n")
        if last_id == end_id:
            return list(newline), suffix
        return [end_id, *newline], suffix


class ChatMLFamily(ChatMLMerge):
    name = "chatml"
    template = CHATML_TEMPLATE
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    required_tokens = ("<|im_start|>", "<|im_end|>")
    default_kwargs = {"default_system": None}

    def parse(self, text: str, *, kwargs: dict[str, Any], tools: Sequence[dict[str, Any]],
              parse_tools: bool) -> ParsedTurn:
        found = parse_hermes_tool_calls(text) if parse_tools else None
        if found is None:
            return ParsedTurn(content=text)
        return ParsedTurn(content=found[0], calls=found[1])
