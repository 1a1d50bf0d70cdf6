"""Reading an agent's text out of a transcript that may hold anything (rewards never raise)."""

from __future__ import annotations

from typing import Any


def message_text(message: Any) -> str:
    """The text of one chat message: a string ``content``, or the text parts of a parts list."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def assistant_texts(transcript: Any) -> list[str]:
    """The text of every assistant message, in order (tool-call-only turns give ``""``)."""
    if not isinstance(transcript, list):
        return []
    return [message_text(m) for m in transcript if isinstance(m, dict) and m.get("role") == "assistant"]


def final_answer(transcript: Any) -> str | None:
    """The last assistant message with non-blank text, or ``None``."""
    for text in reversed(assistant_texts(transcript)):
        if text.strip():
            return text
    return None


def metadata_value(task: Any, key: str) -> Any:
    """``task.metadata[key]`` for any ``task`` (``None`` when absent or not a mapping)."""
    metadata = getattr(task, "metadata", None)
    return metadata.get(key) if isinstance(metadata, dict) else None
