"""``glm``: GLM-4.5+ style (``[gMASK]<sop>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>``,
``<|observation|>``), ``<think>`` reasoning and XML tool calls.

An assistant turn has no end token: the model stops by sampling the *next* turn's opener,
``<|user|>`` or ``<|observation|>``. The boundary merge keeps that opener exactly once: when
the appended suffix starts with the very token the model stopped on, the suffix's copy is
dropped and the sampled one stays (loss mask 1). When the model stopped on another token
(``max_tokens``, ``<|endoftext|>``, or ``<|user|>`` before a tool result) the suffix is kept
whole and the diagnostic reports the extra special token.

Assistant turns render ``<|assistant|>`` + ``\\n<think>{reasoning}</think>`` (when the message
has ``reasoning_content``; empty for thinking-off turns) + ``\\n{content}`` + tool calls
``\\n<tool_call>{name}\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>…\\n</tool_call>``.
Generation prompt: ``<|assistant|>``, plus ``\\n<think></think>`` when thinking is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.tito.families.base import ChatCodec, ChatFamily, ParsedTurn
from miles_engine.tito.parsers import parse_glm_tool_calls, split_reasoning

GLM_TEMPLATE = r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}
{{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:' }}
{{- '\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>' }}
{{- '\n...\n</tool_call>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{{- '<|system|>\n' + message.content }}
{%- elif message.role == 'user' %}
{{- '<|user|>\n' + message.content }}
{%- elif message.role == 'assistant' %}
{{- '<|assistant|>' }}
{%- if message.reasoning_content is string %}
{{- '\n<think>' + message.reasoning_content.strip() + '</think>' }}
{%- endif %}
{%- if message.content.strip() %}{{- '\n' + message.content.strip() }}{%- endif %}
{%- for tc in message.tool_calls %}
{{- '\n<tool_call>' + tc.function.name }}
{%- for k, v in tc.function.arguments_obj.items() %}
{{- '\n<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else (v | tojson)) + '</arg_value>' }}
{%- endfor %}
{{- '\n</tool_call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '\n<think></think>' }}{%- endif %}
{%- endif %}
"""

OPENERS = ("<|user|>", "<|observation|>")


class GLMFamily(ChatFamily):
    name = "glm"
    template = GLM_TEMPLATE
    stop_tokens = ("<|user|>", "<|observation|>", "<|endoftext|>")
    required_tokens = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                       "<think>", "</think>")
    default_kwargs = {"enable_thinking": True}
    request_kwargs = ("enable_thinking",)
    has_reasoning = True
    # the model ends its turn by sampling the next opener; only these two are stop tokens
    allowed_append_roles = ("user", "tool")

    def merge(self, codec: ChatCodec, last_id: int | None, suffix: list[int]) -> tuple[list[int], list[int]]:
        openers = {codec.tokenizer.added_tokens[t] for t in OPENERS}
        if last_id is not None and last_id in openers and suffix and suffix[0] == last_id:
            return [], suffix[1:]
        return [], suffix

    def canonical_tail(self, codec: ChatCodec, last_id: int | None) -> list[int]:
        openers = {codec.tokenizer.added_tokens[t] for t in OPENERS}
        return [last_id] if last_id is not None and last_id in openers else []

    def parse(self, text: str, *, kwargs: dict[str, Any], tools: Sequence[dict[str, Any]],
              parse_tools: bool) -> ParsedTurn:
        reasoning, content = split_reasoning(text, prompt_closed=not self.thinking(kwargs),
                                             strip=str.strip, lstrip_content=str.strip)
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        found = parse_glm_tool_calls(content, schemas) if parse_tools else None
        if found is None:
            return ParsedTurn(content=content, reasoning=reasoning)
        return ParsedTurn(content=found[0], reasoning=reasoning, calls=found[1])
