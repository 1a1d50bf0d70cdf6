"""Chat messages between miles (OpenAI dicts) and verifiers.v1 (typed pydantic messages)."""

from __future__ import annotations

from typing import Any

from miles_engine.environments.protocol import Message


def to_openai(message: Any) -> Message:
    """A verifiers message (or a plain dict) as an OpenAI chat dict with string content."""
    from verifiers.v1.types import content_text

    data = message if isinstance(message, dict) else message.model_dump(exclude_none=True)
    content = data.get("content")
    out: Message = {"role": data["role"], "content": content if isinstance(content, str) else content_text(content)}
    return out


def prompt_messages(data: Any) -> list[Message]:
    """A verifiers TaskData's system prompt and prompt (text or messages) as OpenAI dicts."""
    messages: list[Message] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages.extend(to_openai(m) for m in data.prompt)
    return messages


def to_verifiers(message: Message) -> Any:
    """An OpenAI chat dict from a miles transcript as a typed verifiers message."""
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage

    role = message.get("role")
    content = message.get("content")
    text = content if isinstance(content, str) else ("" if content is None else str(content))
    if role == "assistant":
        calls = [ToolCall(id=str(c.get("id") or f"call_{i}"), name=str((c.get("function") or {}).get("name", "")),
                          arguments=str((c.get("function") or {}).get("arguments") or "{}"))
                 for i, c in enumerate(message.get("tool_calls") or [])]
        return AssistantMessage(content=text or None, tool_calls=calls or None)
    if role == "tool":
        return ToolMessage(tool_call_id=str(message.get("tool_call_id") or ""), content=text)
    if role == "system":
        return SystemMessage(content=text)
    if role == "user":
        return UserMessage(content=text)
    raise ValueError(f"cannot convert a transcript message with role {role!r} for verifiers scoring")
