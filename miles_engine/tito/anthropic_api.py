"""Anthropic Messages wire format on a session: ``POST {base}/v1/messages`` (JSON or SSE) and
``POST {base}/v1/messages/count_tokens``.

A request is translated into the same normalised messages as chat completions, so the same
chat family, matcher and token row serve it:

- ``system`` (a string or text blocks, joined with ``\\n\\n``) → the leading system message;
- a ``system`` message inside ``messages`` (Claude Code sends them) → a system message;
- a user message's ``tool_result`` blocks → one ``tool`` message each (in order, answering a
  ``tool_use`` id of the preceding assistant message), then its text blocks → one user message;
- an assistant message's ``thinking`` blocks → ``reasoning_content``, ``text`` → content,
  ``tool_use`` → tool calls (``input`` serialised by ``json.dumps``, as the server serialised the calls it parsed);
- ``tools[].input_schema`` → function parameters; ``tool_choice`` ``none`` turns parsing off;
  ``thinking`` → the family's ``enable_thinking`` (families with reasoning only).

``cache_control`` and ``citations`` are accepted and ignored; images, documents, server tools
and every token-id field are refused with a 400 naming the field. The reply carries
``thinking`` (families with reasoning), ``text`` and ``tool_use`` blocks with the ids the
harness answers; ``usage.input_tokens`` counts the row's new ids, ``cache_read_input_tokens``
the stored prefix it reused, ``output_tokens`` the sampled ids kept in the row.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles_engine.tito.api import ChatRequest, _int, _number
from miles_engine.tito.errors import BadRequest, TitoError
from miles_engine.tito.families.base import ChatFamily
from miles_engine.tito.messages import Message, normalize_messages, reject_token_fields

KNOWN_FIELDS = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature", "top_p",
                "top_k", "stop_sequences", "stream", "metadata", "thinking", "service_tier", "container",
                "context_management", "betas", "anthropic_version", "output_config"}
_BLOCK_KEYS = {"type", "text", "cache_control", "citations", "id", "name", "input", "tool_use_id", "content",
               "is_error", "thinking", "signature", "data"}
STOP_REASONS = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}
SIGNATURE = "miles-session"  # thinking blocks carry a signature; ours only marks the origin


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{at} must be a content block object with a 'type'", param=at)
        reject_token_fields(block, at, _BLOCK_KEYS)
    return content


def _text_of(block: dict[str, Any], at: str, key: str = "text") -> str:
    text = block.get(key)
    if not isinstance(text, str):
        raise BadRequest(f"{at}.{key} must be a string", param=f"{at}.{key}")
    return text


def _tool_result_text(block: dict[str, Any], at: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{at}.content must be a string or a list of text blocks", param=f"{at}.content")
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{at}.content[{k}]: tool_result content of type {kind!r} is not supported (text only)",
                             param=f"{at}.content[{k}].type")
        parts.append(_text_of(part, f"{at}.content[{k}]"))
    return "\n".join(parts)


def _system(body: dict[str, Any]) -> list[dict[str, Any]]:
    system = body.get("system")
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    else:
        blocks = _blocks(system, "system")
        for j, block in enumerate(blocks):
            if block["type"] != "text":
                raise BadRequest(f"system[{j}]: only text blocks are accepted in system, got {block['type']!r}",
                                 param=f"system[{j}].type")
        text = "\n\n".join(_text_of(b, f"system[{j}]") for j, b in enumerate(blocks))
    return [{"role": "system", "content": text}] if text else []


def _translate(msg: Any, where: str, open_ids: frozenset[str]) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """One Anthropic message → its chat messages, and the tool_use ids open after it."""
    if not isinstance(msg, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    reject_token_fields(msg, where, {"role", "content"})
    role = msg.get("role")
    if role not in ("user", "assistant", "system"):
        raise BadRequest(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}",
                         param=f"{where}.role")
    blocks = _blocks(msg.get("content"), where)
    if role == "system":  # a mid-conversation system message (Claude Code sends them)
        for j, block in enumerate(blocks):
            if block["type"] != "text":
                raise BadRequest(f"{where}.content[{j}].type: a system message holds text blocks only, got "
                                 f"{block['type']!r}", param=f"{where}.content[{j}].type")
        return [{"role": "system", "content": "\n\n".join(_text_of(b, f"{where}.content[{j}]")
                                                           for j, b in enumerate(blocks))}], open_ids
    if role == "assistant":
        texts, thinking, calls = [], [], []
        for j, block in enumerate(blocks):
            at, kind = f"{where}.content[{j}]", block["type"]
            if kind == "text":
                texts.append(_text_of(block, at))
            elif kind == "thinking":
                thinking.append(_text_of(block, at, "thinking"))
            elif kind == "redacted_thinking":
                continue  # opaque: nothing of ours, nothing to render
            elif kind == "tool_use":
                call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(call_id, str) or not call_id:
                    raise BadRequest(f"{at}.id: a tool_use block needs the id the server returned",
                                     param=f"{at}.id")
                if not isinstance(name, str) or not name:
                    raise BadRequest(f"{at}.name: a tool_use block needs a name", param=f"{at}.name")
                if not isinstance(args, dict):
                    raise BadRequest(f"{at}.input must be an object", param=f"{at}.input")
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            else:
                raise BadRequest(f"{at}.type: unknown or unsupported assistant content block type {kind!r} "
                                 "(accepted: text, thinking, redacted_thinking, tool_use)", param=f"{at}.type")
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            entry["reasoning_content"] = "".join(thinking)
        if calls:
            entry["tool_calls"] = calls
        return [entry], frozenset(c["id"] for c in calls)
    results, texts = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in open_ids:
                raise BadRequest(
                    f"{at}.tool_use_id: tool_result answers {call_id!r}, which is no tool_use id of the "
                    f"preceding assistant message (its ids: {', '.join(sorted(open_ids)) or 'none'})",
                    param=f"{at}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, at)})
        else:
            raise BadRequest(f"{at}.type: unknown or unsupported user content block type {kind!r} "
                             "(accepted: text, tool_result)", param=f"{at}.type")
    if texts or not results:
        results.append({"role": "user", "content": "".join(texts)})
    return results, open_ids


HistoryEntry = tuple[Any, list[dict[str, Any]], frozenset[str]]  # (message as sent, its chat messages, open ids)


def to_chat_messages(body: dict[str, Any], history: list[HistoryEntry] | None = None
                     ) -> tuple[list[dict[str, Any]], list[HistoryEntry]]:
    """Anthropic ``system`` + ``messages`` → OpenAI chat messages (validated, with field paths
    of the Anthropic request in every error), and the history entries to pass next turn.

    ``history``: the entries of the session's previous request. A harness re-sends its whole
    history each turn, so the longest prefix it re-sent is not translated again: a message
    equal to the one sent before reuses its translation; one that differs only in how it is
    serialised (Claude Code moves its ``cache_control`` marker to the newest message and sends
    the one that had it as a plain string next turn) is translated, and when that translation
    is the same, the prefix goes on. Reused translations are the same objects as last turn, so
    the normalisation cache and the matcher see them unchanged.
    """
    out = _system(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    entries: list[HistoryEntry] = []
    previous = history or []
    reuse, open_ids = True, frozenset()
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if reuse and i < len(previous):
            sent, chat, ids = previous[i]
            if msg is sent or msg == sent:
                entries.append((msg, chat, ids))
            else:
                fresh, fresh_ids = _translate(msg, where, open_ids)
                reuse = fresh == chat and fresh_ids == ids
                entries.append((msg, chat, ids) if reuse else (msg, fresh, fresh_ids))
        else:
            reuse = False
            entries.append((msg, *_translate(msg, where, open_ids)))
        open_ids = entries[-1][2]
        out.extend(entries[-1][1])
    if out[-1]["role"] == "assistant":
        raise BadRequest(f"messages[{len(raw) - 1}]: a final assistant message (prefill) is not supported: the "
                         "session server owns the assistant turn", param=f"messages[{len(raw) - 1}]")
    return out, entries


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
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(f"{at}.type: server tool {tool.get('type')!r} is not supported; only client tools "
                             "with name and input_schema", param=f"{at}.type")
        name, schema = tool.get("name"), tool.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{at}.name: a tool needs a name", param=f"{at}.name")
        if not isinstance(schema, dict):
            raise BadRequest(f"{at}.input_schema must be a JSON schema object", param=f"{at}.input_schema")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            fn["description"] = str(tool["description"])
        fn["parameters"] = schema
        tools.append({"type": "function", "function": fn})
    return tools


def parse_messages_request(body: Any, family: ChatFamily, cache: list[tuple[Any, Message]] | None = None,
                           *, count_only: bool = False, history: list[HistoryEntry] | None = None
                           ) -> tuple[ChatRequest, list[dict[str, Any]], list[HistoryEntry]]:
    """Validate a Messages body: ``(request, the translated chat messages, history entries)``
    (the second keys the session's normalisation cache, the third its translation cache, see
    :func:`to_chat_messages`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    reject_token_fields(body, "")
    unknown = set(body) - KNOWN_FIELDS
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    chat, entries = to_chat_messages(body, history)
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice") or {}
    if not isinstance(choice, dict) or choice.get("type", "auto") not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}", param="tool_choice")
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None and not count_only:
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise BadRequest("'stop_sequences' must be a list of up to 16 non-empty strings", param="stop_sequences")
    kwargs: dict[str, Any] = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise BadRequest("thinking must be {'type': 'enabled' | 'disabled', ...}", param="thinking.type")
        if "enable_thinking" in family.request_kwargs:
            kwargs["enable_thinking"] = thinking["type"] != "disabled"
    top_k = _int(body, "top_k", 0)
    return ChatRequest(
        messages=normalize_messages(chat, cache),
        tools=tools,
        tools_key=json.dumps(tools, sort_keys=True),
        parse_tools=choice.get("type", "auto") != "none",
        temperature=_number(body, "temperature", 0.0, 1.0, 1.0),
        top_p=_number(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=-1 if not top_k else top_k,
        max_tokens=max_tokens,
        stop=list(stops),
        stream=bool(body.get("stream", False)),
        kwargs=kwargs,
        model=body.get("model") if isinstance(body.get("model"), str) else None,
    ), chat, entries


def content_blocks(assistant: Message, *, with_reasoning: bool) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if with_reasoning and assistant.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": assistant["reasoning_content"], "signature": SIGNATURE})
    if assistant["content"]:
        blocks.append({"type": "text", "text": assistant["content"]})
    for call in assistant.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["name"],
                       "input": json.loads(call["arguments"]) if call["arguments"].strip() else {}})
    return blocks


def message_body(turn: Any, model: str, *, with_reasoning: bool) -> dict[str, Any]:
    """The Messages response of a committed :class:`~miles_engine.tito.service.Turn`."""
    stop_reason = "stop_sequence" if turn.stop_sequence else STOP_REASONS[turn.finish_reason]
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(turn.assistant, with_reasoning=with_reasoning),
        "stop_reason": stop_reason, "stop_sequence": turn.stop_sequence,
        "usage": {"input_tokens": turn.prompt_tokens - turn.cached_tokens, "output_tokens": turn.completion_tokens,
                  "cache_read_input_tokens": turn.cached_tokens, "cache_creation_input_tokens": 0},
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def message_sse(body: dict[str, Any]) -> list[str]:
    """The whole turn as Messages SSE events (generation is not token-streamed: one delta per
    block): message_start, per block content_block_start/delta/stop, message_delta, message_stop."""
    usage = body["usage"]
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 0}}
    events = [_event("message_start", {"message": start})]
    for i, block in enumerate(body["content"]):
        kind = block["type"]
        if kind == "thinking":
            events.append(_event("content_block_start", {"index": i, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}}))
            events.append(_event("content_block_delta", {"index": i, "delta": {
                "type": "thinking_delta", "thinking": block["thinking"]}}))
            events.append(_event("content_block_delta", {"index": i, "delta": {
                "type": "signature_delta", "signature": block["signature"]}}))
        elif kind == "text":
            events.append(_event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}))
            events.append(_event("content_block_delta", {"index": i, "delta": {
                "type": "text_delta", "text": block["text"]}}))
        else:
            events.append(_event("content_block_start", {"index": i, "content_block": {
                "type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}}))
            events.append(_event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        events.append(_event("content_block_stop", {"index": i}))
    events.append(_event("message_delta", {
        "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
        "usage": {"output_tokens": usage["output_tokens"]}}))
    events.append(_event("message_stop", {}))
    return events


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 502: "api_error", 503: "overloaded_error"}


def error_body(exc: TitoError) -> dict[str, Any]:
    """Anthropic's error shape (``{"type": "error", "error": {"type", "message"}}``), plus ``param``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message,
                                       "param": exc.param, "code": exc.code}}
