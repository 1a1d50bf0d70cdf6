"""Reasoning and tool-call parsers: sampled text → (reasoning, content, tool calls).

Parsers never raise on model output: text that does not parse stays content. Arguments are
returned as a dict; the OpenAI wire form (a JSON string) is made by the caller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any]


def split_reasoning(
    text: str,
    *,
    start: str = "<think>",
    end: str = "</think>",
    prompt_closed: bool = False,
    strip: Callable[[str], str] = lambda s: s.strip("\n"),
    lstrip_content: Callable[[str], str] = lambda s: s.lstrip("\n"),
) -> tuple[str | None, str]:
    """Split ``<think>…</think>`` off the front of ``text``.

    :param prompt_closed: the prompt already held an empty think block (reasoning off): the
        whole text is content and the reasoning is ``""`` (so a re-render reproduces the block).
    :return: ``(reasoning or None when the model did not reason, content)``.
    """
    if prompt_closed:
        return "", lstrip_content(text)
    if end in text:
        before, after = text.split(end, 1)
        if start in before:
            before = before.split(start, 1)[1]
        return strip(before), lstrip_content(after)
    stripped = text.lstrip()
    if stripped.startswith(start):  # reasoning cut off by max_tokens
        return strip(stripped[len(start):]), ""
    return None, text


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> tuple[str, list[ParsedCall]] | None:
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks (Qwen, Hermes, ChatML).

    :return: ``(content before the first call, calls)``, or ``None`` when there is no
        well-formed call (then the whole text is content).
    """
    matches = list(_HERMES.finditer(text))
    if not matches:
        return None
    calls: list[ParsedCall] = []
    for m in matches:
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ParsedCall(obj["name"], args))
    return text[: matches[0].start()].rstrip(), calls


_GLM_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm_tool_calls(
    text: str, schemas: dict[str, dict[str, Any]] | None = None
) -> tuple[str, list[ParsedCall]] | None:
    """``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>…</tool_call>`` (GLM-4.5+).

    A value stays a string when the tool's JSON schema says the parameter is a string;
    otherwise values that parse as JSON (numbers, objects …) are decoded.

    :param schemas: tool name → its ``parameters`` JSON schema.
    """
    matches = list(_GLM_CALL.finditer(text))
    if not matches:
        return None
    calls: list[ParsedCall] = []
    for m in matches:
        body = m.group(1)
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "\n" in name:
            return None
        props = ((schemas or {}).get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, raw in _GLM_ARG.findall(body):
            key = key.strip()
            if (props.get(key) or {}).get("type") == "string":
                args[key] = raw
                continue
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        calls.append(ParsedCall(name, args))
    return text[: matches[0].start()].strip(), calls
