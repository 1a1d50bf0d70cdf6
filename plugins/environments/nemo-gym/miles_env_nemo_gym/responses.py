"""The episode as NeMo Gym's ``/verify`` reads it (a Responses-API ``Response``), and its answer.

NeMo Gym's ``simple_agent`` sends ``row | {"response": Response}`` where ``response.output``
holds the new items only: assistant ``message`` items, ``function_call`` items and the
``function_call_output`` items the agent added. The reply is a ``BaseVerifyResponse``
(the request echoed, plus ``reward: float``; optionally ``reward_components``,
``mask_sample``, ``failure_kind``, ``failure_reason``).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from miles_engine.environments.protocol import Message, RewardResult


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(transcript: list[Message]) -> list[dict[str, Any]]:
    """Chat messages the agent produced, as Responses-API output items."""
    items: list[dict[str, Any]] = []
    for msg in transcript:
        role = msg.get("role")
        if role == "assistant":
            text = msg.get("content") or ""
            if text:
                items.append({"id": _id("msg"), "type": "message", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": str(text), "annotations": []}]})
            for call in msg.get("tool_calls") or []:
                fn = call.get("function") or {}
                items.append({"id": _id("fc"), "type": "function_call", "status": "completed",
                              "call_id": str(call.get("id", "")), "name": str(fn.get("name", "")),
                              "arguments": str(fn.get("arguments") or "{}")})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": str(msg.get("tool_call_id", "")),
                          "output": str(msg.get("content") or "")})
    return items


def response_object(transcript: list[Message], params: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``Response`` (OpenAI Responses API) holding the episode's output items."""
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "status": "completed",
        "output": output_items(transcript),
        "parallel_tool_calls": bool(params.get("parallel_tool_calls", True)),
        "tool_choice": params.get("tool_choice", "auto"),
        "tools": list(params.get("tools") or []),
        "error": None,
        "incomplete_details": None,
        "instructions": params.get("instructions"),
        "metadata": params.get("metadata"),
        "temperature": params.get("temperature"),
        "top_p": params.get("top_p"),
    }


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def parse_verify_reply(url: str, status: int, body: str) -> RewardResult:
    """The reward in a ``/verify`` reply, or a failed result naming the URL and what was wrong."""
    snippet = body[:200].replace("\n", " ")
    if not 200 <= status < 300:
        return RewardResult.failed(f"NeMo Gym verify at {url} answered HTTP {status}: {snippet!r}")
    try:
        reply = json.loads(body)
    except ValueError:
        return RewardResult.failed(f"NeMo Gym verify at {url} returned invalid JSON: {snippet!r}")
    if not isinstance(reply, dict):
        return RewardResult.failed(f"NeMo Gym verify at {url} returned a JSON {type(reply).__name__}, not an object")
    if "reward" not in reply:
        return RewardResult.failed(f"NeMo Gym verify at {url} returned no 'reward' field "
                                   f"(fields: {', '.join(sorted(reply)) or 'none'})")
    reward = _number(reply["reward"])
    if reward is None:
        return RewardResult.failed(f"NeMo Gym verify at {url} returned a non-numeric or non-finite reward "
                                   f"{reply['reward']!r}")
    info = {k: reply[k] for k in ("failure_kind", "failure_reason", "mask_sample") if reply.get(k) is not None}
    if reply.get("mask_sample") is True:
        why = reply.get("failure_reason") or reply.get("failure_kind") or "no reason given"
        return RewardResult.failed(f"NeMo Gym verify at {url} masked the sample (not a valid measurement): {why}",
                                   **info)
    raw_components = reply.get("reward_components") or {}
    components: dict[str, float] = {}
    if isinstance(raw_components, dict):
        for key, value in raw_components.items():
            number = _number(value)
            if number is None:
                return RewardResult.failed(f"NeMo Gym verify at {url} returned reward component "
                                           f"'{key}' = {value!r}, not a finite number")
            components[str(key)] = number
    return RewardResult(reward=reward, components=components, info=info)
