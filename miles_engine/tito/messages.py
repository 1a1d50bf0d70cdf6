"""Client chat messages → validated, normalised internal messages.

Internal form (what checkpoints store and matchers compare)::

    {"role": "system"|"user"|"assistant"|"tool", "content": str,
     "reasoning_content": str | None,                      # assistant only
     "tool_calls": [{"id", "name", "arguments": str}],      # assistant only
     "tool_call_id": str}                                   # tool only

``developer`` is rendered as ``system``; text content parts are joined; ``None`` content is
``""``. Anything else is a :class:`BadRequest` naming the field: unknown roles, non-text parts,
tool-call arguments that are not a JSON object, a tool message answering no call of the
preceding assistant message, and any token-id/offset field.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from miles_engine.tito.errors import BadRequest

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields that would let a client inject token ids or offsets: rejected wherever they appear.
_TOKEN_FIELD = re.compile(
    r"(^|_)(input_ids|token_ids|prompt_ids|output_ids|completion_ids|ids|offsets?|token_offsets|"
    r"input_tokens|prompt_tokens|prefix_ids|routed_experts|logprob_start_len|input_embeds)$"
)
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content",
                 "reasoning", "refusal", "function_call", "audio", "annotations"}
_CALL_KEYS = {"id", "type", "function", "index"}


def reject_token_fields(obj: dict[str, Any], where: str, known: frozenset[str] | set[str] = frozenset()) -> None:
    for key in obj:
        if key in known:
            continue
        if isinstance(key, str) and _TOKEN_FIELD.search(key.lower()):
            raise BadRequest(
                f"'{key}' is not accepted: the session server owns the token row, clients never "
                f"send token ids or offsets; send messages only",
                param=f"{where}.{key}" if where else key,
            )


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"content part of type '{kind}' is not supported (text only)",
                                 param=f"{where}.content[{i}]")
        return "".join(parts)
    raise BadRequest(f"content must be a string, a list of text parts or null, got {type(content).__name__}",
                     param=f"{where}.content")


def _tool_calls(raw: Any, where: str) -> list[dict[str, str]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("tool_calls must be a list", param=f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise BadRequest("a tool call must be an object", param=at)
        reject_token_fields(call, at, _CALL_KEYS)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest("a tool call needs function.name (a non-empty string)", param=f"{at}.function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise BadRequest("function.arguments must be a JSON string", param=f"{at}.function.arguments")
        problem = _arguments_problem(args)
        if problem:
            raise BadRequest(problem, param=f"{at}.function.arguments")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest("a tool call needs an 'id' (the id the server returned)", param=f"{at}.id")
        calls.append({"id": call_id, "name": fn["name"], "arguments": args})
    return calls


@functools.lru_cache(maxsize=65536)
def _arguments_problem(args: str) -> str | None:
    """Why tool-call arguments are unusable, or ``None`` (cached: histories replay the same calls)."""
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError as exc:
        return f"function.arguments is not valid JSON: {exc}"
    return None if isinstance(parsed, dict) else "function.arguments must encode a JSON object"


def normalize_messages(raw: Any, cache: list[tuple[Any, Message]] | None = None) -> list[Message]:
    """Validate and normalise a request's ``messages``.

    :param cache: ``(raw, normalised)`` pairs of the session's previous request: the longest
        prefix of raw messages equal to it is reused as is (a harness replays its history, so
        per-turn cost does not grow with the history's size).
    """
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out: list[Message] = []
    open_calls: set[str] = set()  # ids of the latest assistant message's tool calls
    for cached_raw, cached in cache or ():
        i = len(out)
        if i >= len(raw) or raw[i] != cached_raw:
            break
        out.append(cached)
        if cached["role"] == "assistant":
            open_calls = {c["id"] for c in cached["tool_calls"]}
    for i, msg in enumerate(raw[len(out):], start=len(out)):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest("a message must be an object", param=where)
        reject_token_fields(msg, where, _MESSAGE_KEYS)
        role = msg.get("role")
        if role not in ROLES:
            raise BadRequest(f"unknown message role {role!r}; expected one of {', '.join(ROLES)}",
                             param=f"{where}.role")
        unknown = set(msg) - _MESSAGE_KEYS
        if unknown:
            raise BadRequest(f"unknown message field(s) {', '.join(sorted(unknown))}", param=where)
        content = _text(msg.get("content"), where)
        if role == "assistant":
            if msg.get("function_call") is not None:
                raise BadRequest("legacy 'function_call' is not supported; use tool_calls",
                                 param=f"{where}.function_call")
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise BadRequest("reasoning_content must be a string", param=f"{where}.reasoning_content")
            calls = _tool_calls(msg.get("tool_calls"), where)
            open_calls = {c["id"] for c in calls}
            out.append({"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls})
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest("a tool message needs 'tool_call_id'", param=f"{where}.tool_call_id")
            if call_id not in open_calls:
                raise BadRequest(
                    f"tool message answers call id '{call_id}', which the preceding assistant message did "
                    f"not make (its calls: {', '.join(sorted(open_calls)) or 'none'})",
                    param=f"{where}.tool_call_id",
                )
            out.append({"role": "tool", "content": content, "tool_call_id": call_id})
        else:
            if msg.get("tool_calls"):
                raise BadRequest(f"only assistant messages carry tool_calls, not {role}", param=f"{where}.tool_calls")
            out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def normalize_tools(raw: Any) -> list[dict[str, Any]]:
    """Validate ``tools`` (OpenAI function tools) and return them in canonical shape."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadRequest("only function tools are supported", param=at)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest("a tool needs function.name", param=f"{at}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest("function.parameters must be a JSON schema object", param=f"{at}.function.parameters")
        entry: dict[str, Any] = {"name": fn["name"]}
        if fn.get("description") is not None:
            entry["description"] = str(fn["description"])
        entry["parameters"] = params
        tools.append({"type": "function", "function": entry})
    return tools


def template_view(msg: Message) -> dict[str, Any]:
    """The dict a Jinja template sees (HF-style ``tool_calls[].function``, arguments kept verbatim)."""
    view: dict[str, Any] = {"role": msg["role"], "content": msg["content"]}
    if msg["role"] == "assistant":
        view["reasoning_content"] = msg.get("reasoning_content")
        view["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"],
                          "arguments_obj": json.loads(c["arguments"]) if c["arguments"].strip() else {}}}
            for c in msg.get("tool_calls") or []
        ]
    elif msg["role"] == "tool":
        view["tool_call_id"] = msg["tool_call_id"]
    return view
