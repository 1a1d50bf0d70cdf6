"""Representative conversations for ``miles tito check``: tool calls (single and parallel),
reasoning on and off, system prompts (first and mid-conversation), empty content, unicode
(CJK, emoji, RTL, NFD accents, JSON escapes), no system prompt.

A conversation file (``--conversations FILE``) is a JSON list, or JSON lines, of
``{"name", "messages", "tools"?, "kwargs"?}`` with OpenAI-format messages.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}
READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "max_bytes": {"type": "integer"}},
                   "required": ["path"]}}}


def _call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    arguments = json.dumps(args, ensure_ascii=False)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def _asst(content: str, reasoning: str | None = None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def builtin_conversations() -> list[dict[str, Any]]:
    return [
        {"name": "plain", "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2 + 2?"},
            _asst("2 + 2 = 4.", "Simple arithmetic."),
            {"role": "user", "content": "And times 3?"},
            _asst("12.", "4 * 3 = 12."),
        ]},
        {"name": "tools", "tools": [BASH, READ], "messages": [
            {"role": "system", "content": "You operate a Linux shell."},
            {"role": "user", "content": "How many lines are in data.txt?"},
            _asst("Let me count.", "I will use wc.", [_call("call_a1", "bash", {"command": "wc -l data.txt"})]),
            {"role": "tool", "tool_call_id": "call_a1", "content": "42 data.txt\n"},
            _asst("data.txt has 42 lines.", "The tool said 42."),
            {"role": "user", "content": "Show the first bytes of a.txt and b.txt."},
            _asst("", "Two reads in parallel.", [_call("call_b1", "read_file", {"path": "a.txt", "max_bytes": 16}),
                                                 _call("call_b2", "read_file", {"path": "b.txt", "max_bytes": 16})]),
            {"role": "tool", "tool_call_id": "call_b1", "content": "alpha"},
            {"role": "tool", "tool_call_id": "call_b2", "content": "beta"},
            _asst("a.txt starts with 'alpha', b.txt with 'beta'.", "Both reads returned."),
        ]},
        {"name": "thinking_off", "kwargs": {"enable_thinking": False}, "tools": [BASH], "messages": [
            {"role": "user", "content": "List the directory."},
            _asst("", "", [_call("call_c1", "bash", {"command": "ls -la"})]),
            {"role": "tool", "tool_call_id": "call_c1", "content": "total 0\ndrwxr-xr-x 2 root root 40 .\n"},
            _asst("The directory is empty.", ""),
        ]},
        {"name": "empty_content", "tools": [BASH], "messages": [
            {"role": "system", "content": ""},
            {"role": "user", "content": ""},
            _asst("", "Nothing was asked.", [_call("call_d1", "bash", {"command": "true"})]),
            {"role": "tool", "tool_call_id": "call_d1", "content": ""},
            _asst("Done.", "Empty output."),
            {"role": "user", "content": "ok"},
            _asst("", "Nothing to add."),
        ]},
        {"name": "unicode", "tools": [BASH], "messages": [
            {"role": "system", "content": "Réponds en français. 日本語も話せます。"},
            {"role": "user", "content": "Écris « café » et 🚀 dans un fichier, puis montre-le.\tTab\\back"},
            _asst("Voilà 👇", "Il faut échapper les guillemets.",
                  [_call("call_e1", "bash", {"command": "printf 'café 🚀 \"q\" \\\\n' > f.txt && cat f.txt"})]),
            {"role": "tool", "tool_call_id": "call_e1", "content": "café 🚀 \"q\" \\n\nשלום عالم Привет"},
            _asst("Le fichier contient « café 🚀 ». Ça marche — naïve e\u0301.", "Tout est bon ✓"),
        ]},
        {"name": "mid_system_no_first_system", "messages": [
            {"role": "user", "content": "Hi"},
            _asst("Hello! How can I help?", "Greeting."),
            {"role": "system", "content": "From now on answer in one word."},
            {"role": "user", "content": "Colour of the sky?"},
            _asst("Blue.", "One word."),
        ]},
    ]


def adapt(conv: dict[str, Any], *, has_reasoning: bool) -> dict[str, Any]:
    """Drop reasoning from a conversation for a family that has none."""
    conv = copy.deepcopy(conv)
    if not has_reasoning:
        conv.pop("kwargs", None)
        for m in conv["messages"]:
            m.pop("reasoning_content", None)
    return conv


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as exc:
            raise ConfigError(f"{path}: neither JSON nor JSON lines: {exc}") from None
    if isinstance(data, dict):
        data = [data]
    for i, conv in enumerate(data):
        if not isinstance(conv, dict) or not isinstance(conv.get("messages"), list):
            raise ConfigError(f"{path}: conversation #{i} needs a 'messages' list")
        conv.setdefault("name", f"conversation-{i}")
    return data
