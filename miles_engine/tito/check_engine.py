"""The end-to-end part of ``miles tito check``: conversations through the session server's HTTP
API and a real engine, then every trajectory row checked against what the engine was sent and
sampled, id for id.

The conversations' user and tool messages are replayed as a harness would: each assistant
message is the one the server returned (whatever the model sampled); a tool message answers
each call the model made, otherwise the tool output goes back as a user message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.engines.protocol import GenerateRequest, GenerateResult
from miles_engine.tito.check import Conversation, Finding, unsupported
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.service import SessionManager, SessionServerConfig


class RecordingEngine:
    """Wraps a rollout engine and records ``(session_id, input_ids, result)`` per generation."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[tuple[str | None, list[int], GenerateResult]] = []

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await self.inner.generate(request)
        self.log.append((request.session_id, list(request.input_ids), result))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def verify_trajectory(traj: dict[str, Any], records: Sequence[tuple[list[int], GenerateResult]]) -> list[str]:
    """Problems with one trajectory against the engine's records (empty: exact). A turn's ids
    are the engine's output, or a prefix of it when a client stop string cut the turn."""
    row = traj["token_ids"]
    problems = []
    sampled = [0] * len(row)
    for t in traj["turns"]:
        cs, ce = t["completion_start"], t["completion_end"]
        n = ce - cs
        hit = next((res for inp, res in records if inp == row[:cs] and res.output_ids[:n] == row[cs:ce]
                    and (len(res.output_ids) == n or t["finish_reason"] == "stop")), None)
        if hit is None:
            problems.append(f"turn {t['node_id']}: no engine call had row[:{cs}] as input and row[{cs}:{ce}] as output")
            continue
        if traj["rollout_logprobs"][cs:ce] != hit.output_logprobs[:n]:
            problems.append(f"turn {t['node_id']}: rollout_logprobs differ from the engine's")
        if traj["weight_versions"][cs:ce] != hit.weight_versions[:n]:
            problems.append(f"turn {t['node_id']}: weight_versions differ from the engine's")
        if t["owned"]:
            sampled[cs:ce] = [1] * (ce - cs)
    if traj["loss_mask"] != sampled:
        problems.append("loss_mask is not 1 exactly on the sampled ids the trajectory owns")
    in_span = [False] * len(row)
    for t in traj["turns"]:
        in_span[t["completion_start"]:t["completion_end"]] = [True] * (t["completion_end"] - t["completion_start"])
    if any(v is not None or lp != 0.0 for v, lp, s in zip(traj["weight_versions"], traj["rollout_logprobs"], in_span)
           if not s):
        problems.append("an environment token carries a weight version or a non-zero log-prob")
    last = traj["turns"][-1] if traj["turns"] else None
    if last is not None and len(row) != last["completion_end"]:
        problems.append(f"row has {len(row)} ids but its last turn ends at {last['completion_end']}")
    return problems


def _env_block(conv: Conversation, after: int) -> list[dict[str, Any]]:
    out = []
    for msg in conv.messages[after + 1:]:
        if msg["role"] == "assistant":
            break
        out.append(msg)
    return out


def _answer(block: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
    calls = reply.get("tool_calls") or []
    tool_texts = [m["content"] for m in block if m["role"] == "tool"] or ["(no output)"]
    others = [{"role": m["role"], "content": m["content"]} for m in block if m["role"] != "tool"]
    if calls:
        answers = [{"role": "tool", "tool_call_id": c["id"], "content": tool_texts[i % len(tool_texts)]}
                   for i, c in enumerate(calls)]
        return answers + others
    if any(m["role"] == "tool" for m in block):
        others.insert(0, {"role": "user", "content": "Tool output:\n" + "\n".join(tool_texts)})
    return others or [{"role": "user", "content": "Continue."}]


def _wire(msg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg["role"], "content": msg["content"]}
    if msg["role"] == "tool":
        out["tool_call_id"] = msg["tool_call_id"]
    return out


async def engine_roundtrip(codec: ChatCodec, conversations: list[dict[str, Any]], engine: Any, *,
                           max_tokens: int = 24, temperature: float = 1.0, mode: str = "linear") -> list[Finding]:
    import httpx

    from miles_engine.tito.server import create_app

    recorder = RecordingEngine(engine)
    manager = SessionManager(recorder, codec, SessionServerConfig(mode=mode))  # type: ignore[arg-type]
    findings: list[Finding] = []
    transport = httpx.ASGITransport(app=create_app(manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://tito", timeout=600) as client:
        for data in conversations:
            conv = Conversation.from_dict(data)
            skip = unsupported(codec, conv)
            if skip:
                findings.append(Finding("engine", conv.name, True, skip, info=True))
                continue
            try:
                findings.append(await _drive(client, conv, recorder, max_tokens, temperature))
            except Exception as exc:
                findings.append(Finding("engine", conv.name, False, f"{type(exc).__name__}: {exc}"))
    return findings


async def _drive(client: Any, conv: Conversation, recorder: RecordingEngine, max_tokens: int,
                 temperature: float) -> Finding:
    created = (await client.post("/sessions", json={"mode": "linear"})).json()
    sid = created["session_id"]
    base = f"/sessions/{sid}/v1"
    first_asst = next((k for k, m in enumerate(conv.messages) if m["role"] == "assistant"), len(conv.messages))
    history = [_wire(m) for m in conv.messages[:first_asst] if m["role"] != "tool"]
    body = {"messages": history, "tools": conv.tools or None, "max_tokens": max_tokens,
            "temperature": temperature, "chat_template_kwargs": conv.kwargs or None}
    body = {k: v for k, v in body.items() if v is not None}
    asst_positions = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"] or [first_asst]
    for n, k in enumerate(asst_positions):
        resp = await client.post(f"{base}/chat/completions", json={**body, "messages": history})
        if resp.status_code != 200:
            return Finding("engine", conv.name, False, f"turn {n + 1}: HTTP {resp.status_code}: {resp.text[:300]}")
        reply = resp.json()["choices"][0]["message"]
        history = history + [reply]
        if n + 1 < len(asst_positions):
            history += _answer(_env_block(conv, k), reply)
    # a retry of the last turn must replace it and keep the row exact
    last_request = history[: -1] if history and history[-1]["role"] == "assistant" else history
    resp = await client.post(f"{base}/chat/completions", json={**body, "messages": last_request})
    if resp.status_code != 200:
        return Finding("engine", conv.name, False, f"retry: HTTP {resp.status_code}: {resp.text[:300]}")
    report = (await client.get(f"/sessions/{sid}/trajectories")).json()
    await client.delete(f"/sessions/{sid}")
    records = [(inp, res) for s, inp, res in recorder.log if s == sid]
    problems: list[str] = []
    if len(report["trajectories"]) != 1:
        problems.append(f"a linear session gave {len(report['trajectories'])} trajectories")
    for traj in report["trajectories"]:
        problems += verify_trajectory(traj, records)
        last_inp, last_res = records[-1]
        if traj["token_ids"] != last_inp + last_res.output_ids:
            problems.append("the row is not the last engine input + its sampled ids")
    if problems:
        return Finding("engine", conv.name, False, "; ".join(problems[:5]))
    counts = report["trajectories"][0]["tito_session_mismatch"]["counts"]
    turns = len(report["trajectories"][0]["turns"])
    sampled = sum(report["trajectories"][0]["loss_mask"])
    return Finding("engine", conv.name, True,
                   f"{turns} turns, {len(records)} engine calls, {sampled} sampled ids exact; diagnostic {counts}")
