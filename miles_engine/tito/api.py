"""OpenAI chat-completions wire format: request validation and response/SSE building.

Accepted: ``messages``, ``tools``, ``tool_choice``, ``temperature``, ``top_p``, ``top_k``,
``max_tokens`` / ``max_completion_tokens``, ``stop``, ``stream`` (+ ``stream_options``), ``n``
(1 only), ``logprobs`` / ``top_logprobs`` (shape this response only: collection is the
server's), ``seed``, ``chat_template_kwargs`` (the family's switches, e.g. ``enable_thinking``),
and OpenAI's informational fields. Rejected with 400: any token-id/offset field, ``logit_bias``,
a custom ``chat_template``, prompt-editing switches, penalties, non-text response formats.
``tool_choice`` other than ``none`` is accepted but not enforced (no constrained decoding);
``none`` turns tool-call parsing off.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from miles_engine.tito.errors import BadRequest
from miles_engine.tito.families.base import ChatFamily
from miles_engine.tito.messages import Message, normalize_messages, normalize_tools, reject_token_fields

INFORMATIONAL = {"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "reasoning_effort",
                 "prediction", "modalities", "web_search_options", "safety_identifier", "prompt_cache_key",
                 "verbosity"}
REJECTED = {
    "chat_template": "the session server renders with its chat family's template",
    "add_generation_prompt": "the session server decides where the assistant turn opens",
    "continue_final_message": "the session server decides where the assistant turn opens",
    "prompt": "this is the chat endpoint; send messages",
    "echo": "not supported", "suffix": "not supported",
    "functions": "legacy functions are not supported; use tools",
    "function_call": "legacy function_call is not supported; use tool_choice",
    "audio": "audio output is not supported",
}


@dataclass
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]]
    tools_key: str
    parse_tools: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be a number in [{lo:g}, {hi:g}], got {value!r}", param=key)
    return float(value)


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BadRequest(f"'{key}' must be an integer >= {lo}, got {value!r}", param=key)
    return value


def parse_chat_request(body: Any, family: ChatFamily, cache: list[tuple[Any, Message]] | None = None) -> ChatRequest:
    """Validate an OpenAI chat body (``cache``: see :func:`normalize_messages`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    reject_token_fields(body, "")
    for key, why in REJECTED.items():
        if body.get(key) is not None:
            raise BadRequest(f"'{key}' is not accepted: {why}", param=key)
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not accepted: clients never address token ids", param="logit_bias")
    for key in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if body.get(key) not in (None, 0, 0.0, 1.0 if key == "repetition_penalty" else 0):
            raise BadRequest(f"'{key}' is not supported by the rollout engine", param=key)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("only response_format {'type': 'text'} is supported", param="response_format")
    if body.get("n", 1) != 1:
        raise BadRequest("'n' must be 1: open one session per sample", param="n")
    tools = normalize_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function"):
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    unknown = set(kwargs) - set(family.request_kwargs)
    if unknown:
        allowed = ", ".join(family.request_kwargs) or "none"
        raise BadRequest(f"chat_template_kwargs {sorted(unknown)} not accepted by family '{family.name}' "
                         f"(accepted: {allowed})", param="chat_template_kwargs")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 16", param="stop")
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    top_k = _int(body, "top_k", -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", param="seed")
    return ChatRequest(
        messages=normalize_messages(body.get("messages"), cache),
        tools=tools,
        tools_key=json.dumps(tools, sort_keys=True),
        parse_tools=choice != "none",
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=seed,
        max_tokens=max_tokens,
        stop=stops,
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        logprobs=bool(body.get("logprobs", False)),
        kwargs=dict(kwargs),
        model=body.get("model") if isinstance(body.get("model"), str) else None,
    )


def wire_message(message: Message, *, with_reasoning: bool) -> dict[str, Any]:
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in message.get("tool_calls") or []]
    content = message["content"] if message["content"] or not calls else None
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if with_reasoning and message.get("reasoning_content") is not None:
        out["reasoning_content"] = message["reasoning_content"]
    if calls:
        out["tool_calls"] = calls
    return out


@dataclass
class Completion:
    """One finished chat turn, ready to be rendered as JSON or SSE."""

    id: str
    model: str
    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[dict[str, Any]] | None
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def body(self) -> dict[str, Any]:
        choice = {"index": 0, "message": self.message, "finish_reason": self.finish_reason,
                  "logprobs": {"content": self.logprobs} if self.logprobs is not None else None}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def sse(self, include_usage: bool) -> list[str]:
        """The whole turn as SSE events (generation is not token-streamed: one content delta)."""
        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        msg = self.message
        events = [chunk({"role": "assistant", "content": ""})]
        if msg.get("reasoning_content"):
            events.append(chunk({"reasoning_content": msg["reasoning_content"]}))
        if msg.get("content"):
            lp = {"logprobs": {"content": self.logprobs}} if self.logprobs is not None else {}
            events.append(chunk({"content": msg["content"]}, **lp))
        for i, call in enumerate(msg.get("tool_calls") or []):
            events.append(chunk({"tool_calls": [{"index": i, **call}]}))
        events.append(chunk({}, self.finish_reason))
        if include_usage:
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage()}
            events.append(f"data: {json.dumps(body)}\n\n")
        events.append("data: [DONE]\n\n")
        return events
