"""Conformance checks every chat family (and harness) must pass: ``miles tito check``.

1. ``append_only`` — rendering through each assistant turn is a token prefix of rendering the
   whole conversation, and the generation prompt is a text prefix of the assistant turn. A
   failure names the first differing token.
2. ``incremental`` — building the row the way the server does (first turn rendered once; then
   the canonical ids of each assistant turn as "sampled" ids, boundary merge, appended messages
   tokenized alone) gives the canonical tokenization: no special-token or non-assistant
   difference.
3. ``parse`` — the family's parsers invert its template on every assistant turn (content,
   reasoning, tool-call names and arguments).
4. ``engine`` — an end-to-end round trip through the session server's HTTP API and a real
   engine (:mod:`.check_engine`): every trajectory row is exactly the engine's last input ids
   plus its sampled ids, each turn's prompt is the row before it, and the loss mask covers the
   sampled ids exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from miles_engine.tito.diagnostic import classify
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.messages import Message, normalize_messages, normalize_tools


@dataclass
class Finding:
    check: str
    conversation: str
    ok: bool
    message: str = ""
    info: bool = False  # an observation that does not fail the check

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "conversation": self.conversation, "ok": self.ok,
                "message": self.message, "info": self.info}


@dataclass
class Conversation:
    name: str
    messages: list[Message]
    tools: list[dict[str, Any]]
    kwargs: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        return cls(str(data.get("name", "conversation")), normalize_messages(data["messages"]),
                   normalize_tools(data.get("tools")), dict(data.get("kwargs") or {}))


def first_token_difference(codec: ChatCodec, a: list[int], b: list[int]) -> str:
    """Describe where two id rows first differ (``a``: the shorter render, ``b``: the full one)."""
    tok = codec.tokenizer
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    got = tok.describe(a[i]) if i < len(a) else "<end>"
    want = tok.describe(b[i]) if i < len(b) else "<end>"
    context = tok.decode(b[max(0, i - 8):i])
    return f"first differing token at index {i}: {got} where the full render has {want} (after {context!r})"


def check_append_only(codec: ChatCodec, conv: Conversation) -> Finding:
    kw = codec.kwargs(conv.kwargs)
    full_text = codec.render(conv.messages, conv.tools, add_generation_prompt=False, kwargs=kw)
    full = codec.tokenizer.encode(full_text)
    for k, msg in enumerate(conv.messages):
        if msg["role"] != "assistant" or k == 0:
            continue
        turn_text = codec.render(conv.messages[: k + 1], conv.tools, add_generation_prompt=False, kwargs=kw)
        turn = codec.tokenizer.encode(turn_text)
        if full[: len(turn)] != turn or not full_text.startswith(turn_text):
            return Finding("append_only", conv.name, False,
                           f"not append-only after messages[{k}] (assistant): rendering the history through it is "
                           "not a prefix of rendering the whole conversation; "
                           + first_token_difference(codec, turn, full))
        prompt_text = codec.render(conv.messages[:k], conv.tools, add_generation_prompt=True, kwargs=kw)
        if not turn_text.startswith(prompt_text):
            prompt = codec.tokenizer.encode(prompt_text)
            return Finding("append_only", conv.name, False,
                           f"the generation prompt before messages[{k}] is not a prefix of that assistant turn "
                           f"(is reasoning_content consistent with enable_thinking?); "
                           f"{first_token_difference(codec, prompt, turn)}")
    return Finding("append_only", conv.name, True)


def _assistant_turns(codec: ChatCodec, conv: Conversation) -> list[tuple[int, list[int], str]]:
    """``(message index, canonical "sampled" ids incl. the stop token, sampled text w/o stop)``."""
    kw = codec.kwargs(conv.kwargs)
    full_text = codec.render(conv.messages, conv.tools, add_generation_prompt=False, kwargs=kw)
    out = []
    for k, msg in enumerate(conv.messages):
        if msg["role"] != "assistant" or k == 0:
            continue
        prompt = codec.render(conv.messages[:k], conv.tools, add_generation_prompt=True, kwargs=kw)
        turn = codec.render(conv.messages[: k + 1], conv.tools, add_generation_prompt=False, kwargs=kw)
        ids = codec.tokenizer.encode(turn[len(prompt):])
        stop_at = next((i for i, t in enumerate(ids) if t in codec.stop_ids), None)
        if stop_at is not None:
            ids = ids[: stop_at + 1]
        else:
            following = codec.tokenizer.encode(full_text[len(turn):])[:1]
            ids.append(following[0] if following and following[0] in codec.stop_ids else codec.stop_ids[0])
        out.append((k, ids, codec.tokenizer.decode(ids[:-1])))
    return out


def check_incremental(codec: ChatCodec, conv: Conversation) -> list[Finding]:
    kw = codec.kwargs(conv.kwargs)
    row: list[int] = []
    sampled: list[bool] = []
    consumed = 0
    turns = _assistant_turns(codec, conv)
    if not turns:
        return [Finding("incremental", conv.name, True, "no assistant turn to check", info=True)]
    for k, ids, _ in turns:
        if not row:
            env = codec.encode_conversation(conv.messages[:k], conv.tools, add_generation_prompt=True, kwargs=kw)
        else:
            env = codec.append_ids(row[-1], conv.messages[consumed:k], conv.tools, kwargs=kw)
        row += env + ids
        sampled += [False] * len(env) + [True] * len(ids)
        consumed = k + 1
    last = turns[-1][0]
    canonical = codec.encode_conversation(conv.messages[: last + 1], conv.tools, add_generation_prompt=False, kwargs=kw)
    close, _ = codec.family.merge(codec, row[-1], [])
    report = classify(row + close, sampled + [False] * len(close),
                      canonical + codec.family.canonical_tail(codec, row[-1]), codec.tokenizer)
    if report["bug"]:
        bad = {t: n for t, n in report["counts"].items() if n and t != "assistant_text"}
        return [Finding("incremental", conv.name, False,
                        f"the incrementally built row differs from the canonical render: {bad}; "
                        f"{json.dumps(report['details'][:2], ensure_ascii=False)}")]
    findings = [Finding("incremental", conv.name, True)]
    if report["counts"]["assistant_text"]:
        findings.append(Finding("incremental", conv.name, True, info=True, message=(
            f"{report['counts']['assistant_text']} assistant turn(s) tokenize differently inside a full render "
            "(BPE across the assistant opener): expected, the row keeps the sampled ids")))
    return findings


def check_parse(codec: ChatCodec, conv: Conversation) -> Finding:
    kw = codec.kwargs(conv.kwargs)
    tok = codec.tokenizer

    def norm(text: str | None) -> str | None:  # the tokenizer's own normalisation (NFC on Qwen)
        return tok.decode(tok.encode(text)) if text else None

    for k, _, text in _assistant_turns(codec, conv):
        want = conv.messages[k]
        got = codec.family.parse(text, kwargs=kw, tools=conv.tools, parse_tools=bool(conv.tools))
        problems = []
        if norm(got.content) != norm(want["content"]):
            problems.append(f"content {got.content!r} != {want['content']!r}")
        if codec.family.has_reasoning and norm(got.reasoning) != norm(want.get("reasoning_content")):
            problems.append(f"reasoning {got.reasoning!r} != {want.get('reasoning_content')!r}")
        calls = [(c.name, c.arguments) for c in got.calls]
        expected = [(c["name"], json.loads(c["arguments"] or "{}")) for c in want.get("tool_calls") or []]
        if calls != expected:
            problems.append(f"tool calls {calls} != {expected}")
        if problems:
            return Finding("parse", conv.name, False,
                           f"messages[{k}]: parsing the rendered turn does not give the message back: "
                           + "; ".join(problems))
    return Finding("parse", conv.name, True)


def unsupported(codec: ChatCodec, conv: Conversation) -> str | None:
    """Why the family cannot serve this conversation (a role it cannot append), or ``None``."""
    allowed = codec.family.allowed_append_roles
    for k, msg in enumerate(conv.messages[:-1]):
        nxt = conv.messages[k + 1]["role"]
        if msg["role"] == "assistant" and allowed is not None and nxt not in allowed:
            return (f"skipped: family '{codec.name}' cannot append a '{nxt}' message after an assistant turn "
                    f"(allowed: {', '.join(allowed)})")
    return None


def check_rendering(codec: ChatCodec, conversations: list[dict[str, Any]]) -> list[Finding]:
    """Checks 1–3 over ``conversations`` (dicts as in :mod:`.conversations`)."""
    findings: list[Finding] = []
    for data in conversations:
        try:
            conv = Conversation.from_dict(data)
        except Exception as exc:
            findings.append(Finding("load", str(data.get("name")), False, f"{type(exc).__name__}: {exc}"))
            continue
        skip = unsupported(codec, conv)
        if skip:
            findings.append(Finding("load", conv.name, True, info=True, message=skip))
            continue
        for fn in (check_append_only, check_incremental, check_parse):
            try:
                result = fn(codec, conv)
            except Exception as exc:
                result = Finding(fn.__name__.removeprefix("check_"), conv.name, False, f"{type(exc).__name__}: {exc}")
            findings.extend(result if isinstance(result, list) else [result])
    return findings
