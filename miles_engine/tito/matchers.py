"""Message matchers: does a replayed message stand for a stored one?

A matcher only *locates* a checkpoint; the stored token ids are reused verbatim whatever the
replayed text says. Signature: ``matcher(stored: Message, replayed: Message) -> bool`` over
normalised messages (:mod:`.messages`). Built-ins:

- ``strict`` (default): role, content, tool-call id/name/arguments text, tool_call_id; the
  reasoning is compared only when the client sends it back (most clients drop it).
- ``loose_tool_call``: ``strict`` with tool-call arguments compared as JSON values (key order
  and whitespace may differ).
- ``role_content_only``: role and content only (high risk: tool calls are not compared).

Or a dotted path (``package.module:function``) loaded with :func:`miles_engine.loader.load_object`.
A matcher that raises or returns a non-bool is a server error naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.loader import load_object, looks_like_import_path
from miles_engine.tito.errors import MatcherError
from miles_engine.tito.messages import Message

Matcher = Callable[[Message, Message], bool]


def _base(stored: Message, replayed: Message) -> bool:
    if stored["role"] != replayed["role"] or stored["content"] != replayed["content"]:
        return False
    if stored["role"] == "tool":
        return stored.get("tool_call_id") == replayed.get("tool_call_id")
    if stored["role"] == "assistant":
        theirs = replayed.get("reasoning_content")
        if theirs is not None and (stored.get("reasoning_content") or "") != theirs:
            return False
    return True


def _calls(msg: Message) -> list[dict[str, str]]:
    return msg.get("tool_calls") or []


def strict(stored: Message, replayed: Message) -> bool:
    if not _base(stored, replayed):
        return False
    a, b = _calls(stored), _calls(replayed)
    return len(a) == len(b) and all(
        x["id"] == y["id"] and x["name"] == y["name"] and x["arguments"] == y["arguments"] for x, y in zip(a, b)
    )


def _json(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return text


def loose_tool_call(stored: Message, replayed: Message) -> bool:
    if not _base(stored, replayed):
        return False
    a, b = _calls(stored), _calls(replayed)
    return len(a) == len(b) and all(
        x["id"] == y["id"] and x["name"] == y["name"] and _json(x["arguments"]) == _json(y["arguments"])
        for x, y in zip(a, b)
    )


def role_content_only(stored: Message, replayed: Message) -> bool:
    return stored["role"] == replayed["role"] and stored["content"] == replayed["content"]


BUILTIN_MATCHERS: dict[str, Matcher] = {
    "strict": strict,
    "loose_tool_call": loose_tool_call,
    "role_content_only": role_content_only,
}


def resolve_matcher(ref: str | Matcher) -> Matcher:
    """A built-in name, a dotted path, or a callable → a checked matcher."""
    if callable(ref):
        fn, name = ref, getattr(ref, "__name__", repr(ref))
    elif ref in BUILTIN_MATCHERS:
        return BUILTIN_MATCHERS[ref]
    elif looks_like_import_path(ref):
        fn, name = load_object(ref), ref
        if not callable(fn):
            raise ConfigError(f"matcher '{ref}' is not callable")
    else:
        raise ConfigError(f"unknown matcher '{ref}'; use one of {', '.join(BUILTIN_MATCHERS)} or a dotted path")

    def checked(stored: Message, replayed: Message) -> bool:
        try:
            result = fn(stored, replayed)
        except Exception as exc:
            raise MatcherError(f"message matcher '{name}' raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, bool):
            raise MatcherError(f"message matcher '{name}' returned {type(result).__name__}, expected bool")
        return result

    return checked
