"""OpenAI Responses wire format on a session: ``POST {base}/v1/responses`` (JSON or SSE).

Input items are translated into the same normalised messages as chat completions:

- ``message`` (roles user, system, developer, assistant; text parts) → that message;
- consecutive assistant-side items (``reasoning``, assistant ``message``, ``function_call``)
  → one assistant message (reasoning text, content, tool calls with ``call_id`` as the id);
- ``function_call_output`` → a ``tool`` message answering a ``call_id`` of the assistant
  message before it;
- ``instructions`` → the leading system message; ``previous_response_id`` → the whole
  conversation of that response (kept by the session) before ``input``.

Tools: ``function`` tools; the built-in tool types a policy cannot call here (``web_search``,
``file_search``, ``namespace``, ``local_shell`` …, see :data:`IGNORED_TOOL_TYPES`) are dropped
(Codex sends them whatever the provider). The reply's ``output`` holds a ``reasoning`` item
(families with reasoning), a ``message`` item and ``function_call`` items; usage counts as in
chat completions (``input_tokens_details.cached_tokens``: the stored prefix reused).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from miles_engine.tito.api import ChatRequest, _int, _number, wire_message
from miles_engine.tito.errors import BadRequest
from miles_engine.tito.families.base import ChatFamily
from miles_engine.tito.messages import Message, normalize_messages, reject_token_fields

KNOWN_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                "previous_response_id", "store", "stream", "stream_options", "max_output_tokens", "temperature",
                "top_p", "top_k", "reasoning", "include", "text", "metadata", "truncation", "prompt_cache_key",
                "user", "service_tier", "client_metadata", "safety_identifier", "background", "top_logprobs",
                "max_tool_calls", "prompt_cache_retention"}
IGNORED_TOOL_TYPES = {"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                      "computer_use_preview", "mcp", "namespace", "local_shell", "tool_search"}
_ITEM_KEYS = {"type", "id", "role", "content", "status", "call_id", "name", "arguments", "output", "summary",
              "encrypted_content", "phase"}
_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def _text(content: Any, at: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{at} must be a string or a list of text parts", param=at)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _PART_TYPES or not isinstance(part.get("text", part.get("refusal")), str):
            raise BadRequest(f"{at}[{k}].type: content part {kind!r} is not supported (text parts only)",
                             param=f"{at}[{k}].type")
        parts.append(part.get("text", part.get("refusal")))
    return "".join(parts)


@dataclass
class History:
    """The translation of a stateless request's input (Codex re-sends all of it each turn):
    ``marks[i]``: (chat messages, open call ids) once ``items[:i + 1]`` are translated, None
    while an assistant message is still being assembled there."""

    instructions: str | None
    items: list[Any]
    marks: list[tuple[int, frozenset[str]] | None]
    out: list[dict[str, Any]]

    def resume(self, instructions: str | None, items: list[Any]) -> int:
        """How many leading ``items`` need no translation (their chat messages are ``out``)."""
        if instructions != self.instructions:
            return 0
        k, n = 0, min(len(items), len(self.items))
        while k < n and (items[k] is self.items[k] or items[k] == self.items[k]):
            k += 1
        while k and self.marks[k - 1] is None:
            k -= 1
        return k


def to_chat_messages(body: dict[str, Any], previous: list[Message] | None, history: History | None = None
                     ) -> tuple[list[Message], list[Any], History]:
    """``(normalised messages of the stored previous response, new chat messages to normalise,
    the translation to pass as history next turn)``. With ``history`` (the session's previous
    stateless request), the longest prefix of items re-sent unchanged reuses its translation
    (the same objects, so the normalisation cache and the matcher see them unchanged)."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    if instructions and previous is None:
        out.append({"role": "system", "content": instructions})
    raw = body.get("input")
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or (not items and previous is None):
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    open_ids = {c["id"] for c in (previous[-1].get("tool_calls") or [])} if previous else set()
    pending: dict[str, Any] | None = None  # the assistant message being assembled
    marks: list[tuple[int, frozenset[str]] | None] = []
    start = history.resume(instructions, items) if history is not None and previous is None else 0
    if start:
        n, ids = history.marks[start - 1]  # type: ignore[union-attr,misc]
        out, open_ids, marks = history.out[:n], set(ids), history.marks[:start]  # type: ignore[union-attr]

    def flush() -> None:
        nonlocal pending, open_ids
        if pending is not None:
            if not pending["reasoning_content"]:
                pending.pop("reasoning_content")
            if not pending["tool_calls"]:
                pending.pop("tool_calls")
            out.append(pending)
            open_ids = {c["id"] for c in pending.get("tool_calls", [])}
            pending = None

    def assistant() -> dict[str, Any]:
        nonlocal pending
        if pending is None:
            pending = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
        return pending

    for i, item in enumerate(items[start:], start):
        if i > start:
            marks.append((len(out), frozenset(open_ids)) if pending is None else None)
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{at} must be an object", param=at)
        reject_token_fields(item, at, _ITEM_KEYS)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{at}.role must be user, system, developer or assistant, got {role!r}",
                                 param=f"{at}.role")
            text = _text(item.get("content"), f"{at}.content")
            if role == "assistant":
                assistant()["content"] += text
                continue
            flush()
            out.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or []
            text = _text(parts, f"{at}.content") if parts else ""
            assistant()["reasoning_content"] += text
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{at}.call_id: a function_call needs the call_id the server returned",
                                 param=f"{at}.call_id")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{at}.name: a function_call needs a name", param=f"{at}.name")
            if not isinstance(args, str):
                raise BadRequest(f"{at}.arguments must be a JSON string", param=f"{at}.arguments")
            assistant()["tool_calls"].append({"id": call_id, "type": "function",
                                              "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            flush()
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in open_ids:
                raise BadRequest(
                    f"{at}.call_id: function_call_output answers {call_id!r}, which is no call_id of the "
                    f"preceding assistant output (its ids: {', '.join(sorted(open_ids)) or 'none'})",
                    param=f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{at}.output")})
        else:
            raise BadRequest(f"{at}.type: unknown or unsupported input item type {kind!r} (accepted: message, "
                             "reasoning, function_call, function_call_output)", param=f"{at}.type")
    if len(items) > start:
        marks.append((len(out), frozenset(open_ids)) if pending is None else None)
    flush()
    if out and out[-1]["role"] == "assistant":
        raise BadRequest("the input ends with assistant output: the session server owns the assistant turn",
                         param=f"input[{len(items) - 1}]")
    return list(previous or []), out, History(instructions, items, marks, out)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{at} must be an object", param=at)
        kind = tool.get("type")
        if kind in IGNORED_TOOL_TYPES:
            continue
        if kind != "function":
            raise BadRequest(f"{at}.type: tool type {kind!r} is not supported (function tools; ignored: "
                             f"{', '.join(sorted(IGNORED_TOOL_TYPES))})", param=f"{at}.type")
        name, params = tool.get("name"), tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{at}.name: a function tool needs a name", param=f"{at}.name")
        if not isinstance(params, dict):
            raise BadRequest(f"{at}.parameters must be a JSON schema object", param=f"{at}.parameters")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            fn["description"] = str(tool["description"])
        fn["parameters"] = params
        tools.append({"type": "function", "function": fn})
    return tools


def parse_responses_request(body: Any, family: ChatFamily, stored: dict[str, list[Message]],
                            cache: list[tuple[Any, Message]] | None = None, history: History | None = None
                            ) -> tuple[ChatRequest, list[Any], History]:
    """Validate a Responses body against the session's stored responses: ``(request, the new
    chat messages, their translation)`` (the second keys the session's normalisation cache, the
    third its translation cache, see :func:`to_chat_messages`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    reject_token_fields(body, "")
    unknown = set(body) - KNOWN_FIELDS
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    if body.get("background"):
        raise BadRequest("background responses are not supported", param="background")
    prev_id = body.get("previous_response_id")
    previous = None
    if prev_id is not None:
        previous = stored.get(prev_id) if isinstance(prev_id, str) else None
        if previous is None:
            raise BadRequest(f"previous_response_id {prev_id!r} is no response of this session",
                             param="previous_response_id")
    prior, chat, translated = to_chat_messages(body, previous, history)
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function"):
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice")
    kwargs: dict[str, Any] = {}
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise BadRequest("'reasoning' must be an object", param="reasoning")
    effort = (reasoning or {}).get("effort")
    if effort is not None and "enable_thinking" in family.request_kwargs:
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    top_k = _int(body, "top_k", 0)
    if prior and chat and prior[-1]["role"] == "assistant":
        # the stored assistant turn heads the new items, so their tool outputs answer its calls
        head = wire_message(prior[-1], with_reasoning=False)
        messages = prior + normalize_messages([head, *chat])[1:]
    else:
        messages = prior + normalize_messages(chat, cache) if chat else prior
    if not messages:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    return ChatRequest(
        messages=messages,
        tools=tools,
        tools_key=json.dumps(tools, sort_keys=True),
        parse_tools=choice != "none",
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=-1 if not top_k else top_k,
        max_tokens=_int(body, "max_output_tokens", 1),
        stream=bool(body.get("stream", False)),
        kwargs=kwargs,
        model=body.get("model") if isinstance(body.get("model"), str) else None,
    ), chat, translated


def output_items(assistant: Message, *, with_reasoning: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if with_reasoning and assistant.get("reasoning_content"):
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": assistant["reasoning_content"]}]})
    if assistant["content"] or not assistant.get("tool_calls"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                      "status": "completed", "content": [{"type": "output_text", "text": assistant["content"],
                                                          "annotations": []}]})
    for call in assistant.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                      "name": call["name"], "arguments": call["arguments"], "status": "completed"})
    return items


def response_body(turn: Any, req: ChatRequest, model: str, *, with_reasoning: bool,
                  response_id: str) -> dict[str, Any]:
    """The Responses object of a committed :class:`~miles_engine.tito.service.Turn`."""
    incomplete = turn.finish_reason == "length"
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "output": output_items(turn.assistant, with_reasoning=with_reasoning),
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": req.temperature,
        "top_p": req.top_p, "max_output_tokens": req.max_tokens, "previous_response_id": None,
        "usage": {"input_tokens": turn.prompt_tokens, "input_tokens_details": {"cached_tokens": turn.cached_tokens},
                  "output_tokens": turn.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": turn.prompt_tokens + turn.completion_tokens},
    }


def response_sse(body: dict[str, Any]) -> list[str]:
    """The whole turn as Responses SSE events (one delta per item): response.created, per item
    output_item.added / (content_part / output_text | function_call_arguments) / output_item.done,
    then response.completed (or response.incomplete) with usage."""
    seq = iter(range(1 << 30))
    events: list[str] = []

    def emit(kind: str, **data: Any) -> None:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        events.append(f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n")

    opening = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for i, item in enumerate(body["output"]):
        kind = item["type"]
        if kind == "message":
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            emit("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                 part={**part, "text": ""})
            emit("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                 delta=part["text"], logprobs=[])
            emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                 text=part["text"], logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        elif kind == "function_call":
            emit("response.output_item.added", output_index=i,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                 arguments=item["arguments"], name=item["name"])
        else:
            emit("response.output_item.added", output_index=i, item={**item, "content": []})
            text = item["content"][0]["text"]
            emit("response.reasoning_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text)
            emit("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
    return events
