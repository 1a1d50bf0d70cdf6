"""Chat transcripts (OpenAI messages with ``tool_calls`` and ``tool`` results) → exact token rows.

A transcript's prompt is its messages before the first assistant turn; every assistant turn
after it is trained on (loss mask 1), everything else is context (mask 0), laid out exactly as
the TITO session server builds a row (:func:`miles_engine.tito.rows.conversation_row`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from miles_engine.components import Section
from miles_engine.data.errors import DataError
from miles_engine.tito.errors import BadRequest
from miles_engine.tito.messages import normalize_messages, normalize_tools
from miles_engine.tito.rows import conversation_row

Message = dict[str, Any]


class TranscriptFields(Section):
    messages: str = Field("messages", description="column holding the OpenAI messages (a list or a JSON string)")
    tools: str | None = Field("tools", description="column holding the tools offered (OpenAI function tools); "
                              "absent or null: none")
    id: str | None = Field(None, description="column with a transcript id (used by the hash split; default: "
                           "the row's content hash)")


@dataclass
class Transcript:
    id: str
    prompt: list[Message]
    turns: list[Message]
    tools: list[dict[str, Any]] | None
    row: int


def _json_field(row: dict[str, Any], key: str, file: str, number: int) -> Any:
    value = row.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise DataError(file, f"is a string but not JSON: {exc}", row=number, field=key) from None
    return value


def parse_transcript(row: dict[str, Any], fields: TranscriptFields, file: str, number: int) -> Transcript:
    """Validate one row (message shapes, tool-call ids, one assistant turn at least, ends on one)."""
    if fields.messages not in row:
        raise DataError(file, "is missing", row=number, field=fields.messages)
    messages = _json_field(row, fields.messages, file, number)
    tools = _json_field(row, fields.tools, file, number) if fields.tools and fields.tools in row else None
    try:
        normalized = normalize_messages(messages)
    except BadRequest as exc:
        param = exc.param or ""
        at = f"{fields.messages}{param[len('messages'):]}" if param.startswith("messages") else fields.messages
        raise DataError(file, exc.message, row=number, field=at) from None
    try:
        tools = normalize_tools(tools) or None
    except BadRequest as exc:
        at = f"{fields.tools}{(exc.param or '')[len('tools'):]}"
        raise DataError(file, exc.message, row=number, field=at) from None
    first = next((i for i, m in enumerate(normalized) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        why = "has no assistant turn" if first is None else "opens with an assistant turn (no prompt before it)"
        raise DataError(file, f"{why}: nothing to train on", row=number, field=fields.messages)
    if normalized[-1]["role"] != "assistant":
        raise DataError(file, f"ends with a '{normalized[-1]['role']}' message; a transcript ends with an assistant "
                        f"turn", row=number, field=fields.messages)
    raw = list(messages)
    if fields.id:
        if row.get(fields.id) is None:
            raise DataError(file, "is missing", row=number, field=fields.id)
        tid = str(row[fields.id])
    else:
        import hashlib

        tid = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Transcript(tid, raw[:first], raw[first:], tools, number)


def transcript_row(codec: Any, transcript: Transcript, file: str, field: str = "messages") -> tuple[list[int], list[int]]:
    """``(token_ids, loss_mask)``; a template that cannot render the row names it."""
    try:
        return conversation_row(codec, transcript.prompt, transcript.turns, transcript.tools)
    except Exception as exc:  # noqa: BLE001 - jinja, TemplateError, ValueError: one line naming the row
        raise DataError(file, f"chat family '{codec.name}' cannot render it: {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]}", row=transcript.row, field=field) from None
