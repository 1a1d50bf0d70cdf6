"""Per wire format: the history a harness re-sends each turn is translated once (Claude Code's
moving ``cache_control`` marker included), the row stays exact, and the server's and the
trainer's metrics give mismatches by type per wire format (chat, messages, responses)."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any


from miles_engine.rollout.types import Group, Trajectory
from miles_engine.tito import anthropic_api, responses_api
from miles_engine.tito.diagnostic import summarize_by_wire
from miles_engine.run.step_metrics import group_metrics

from .helpers import BASH, asgi, assert_exact, make_server, sampled_text

TOOL = {"name": "bash", "input_schema": BASH["function"]["parameters"]}
FN = {"type": "function", "name": "bash", "parameters": BASH["function"]["parameters"]}
CC = {"type": "ephemeral"}
TURNS = 6


def _cc_last(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Claude Code sends: the newest message's last block carries cache_control; the message
    that carried it last turn comes back as a plain string (or its blocks without the marker)."""
    out = copy.deepcopy(messages)
    last = out[-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"], "cache_control": CC}]
    else:
        last["content"][-1]["cache_control"] = CC
    return out


def test_messages_history_is_translated_once_and_the_row_stays_exact(codecs, monkeypatch):
    asyncio.run(_messages_history(codecs, monkeypatch))


async def _messages_history(codecs, monkeypatch):
    manager, engine, scripts = make_server(codecs["qwen3"])
    calls = []
    real = anthropic_api._translate
    monkeypatch.setattr(anthropic_api, "_translate", lambda *a: calls.append(a[1]) or real(*a))
    async with asgi(manager) as http:
        sid = (await http.post("/sessions", json={})).json()["session_id"]
        scripts.add(sid, *[sampled_text("qwen3", reasoning=f"Step {i}.", command=f"echo {i}") for i in range(TURNS)],
                    sampled_text("qwen3", content="All done.", reasoning="Report."))
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Echo six numbers."}]
        per_turn, output_tokens, first_ids = [], 0, []
        for turn in range(TURNS + 1):
            calls.clear()
            body = {"model": "p", "max_tokens": 128, "tools": [TOOL], "messages": _cc_last(messages),
                    "system": [{"type": "text", "text": "You run commands.", "cache_control": CC}]}
            r = await http.post(f"/sessions/{sid}/v1/messages", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            output_tokens += out["usage"]["output_tokens"]
            per_turn.append(len(calls))
            first_ids.append(id(manager.get(sid).wire_history["messages"][0][0][1][0]))
            messages.append({"role": "assistant", "content": out["content"]})
            uses = [b for b in out["content"] if b["type"] == "tool_use"]
            if not uses:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"], "content": f"{turn}\n"} for b in uses]})
        report = (await http.delete(f"/sessions/{sid}?trajectories=true")).json()
    # turn k sends 2k+1 messages; translated: the re-serialised one, the assistant turn and its results
    assert per_turn[0] == 1 and max(per_turn[1:]) <= 3, per_turn
    assert len(set(first_ids)) == 1  # the first message's translation is the same object every turn
    assert len(report["trajectories"]) == 1 and len(report["trajectories"][0]["turns"]) == TURNS + 1
    assert sum(report["trajectories"][0]["loss_mask"]) == output_tokens
    assert_exact(report, engine, sid)


def test_messages_history_never_reuses_a_changed_message():
    def body(result: str, cc: bool) -> dict[str, Any]:
        msgs = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}]},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
        if cc:
            msgs[2]["content"][0]["cache_control"] = CC
        return {"messages": msgs}

    _, history = anthropic_api.to_chat_messages(body("one", cc=True))
    same, kept = anthropic_api.to_chat_messages(body("one", cc=False), history)
    assert same == anthropic_api.to_chat_messages(body("one", cc=False))[0]
    assert all(a[1] is b[1] for a, b in zip(history, kept))  # the marker moved: every translation reused
    edited, after = anthropic_api.to_chat_messages(body("two", cc=False), history)
    assert edited == anthropic_api.to_chat_messages(body("two", cc=False))[0]
    assert edited[2]["content"] == "two"
    assert after[2][1] is not history[2][1] and after[3][1] is not history[3][1]  # no reuse past a change


def _codex_items(n: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"type": "message", "id": "m0", "role": "user",
                                    "content": [{"type": "input_text", "text": "Echo numbers."}]}]
    for i in range(n):
        items += [{"type": "reasoning", "id": f"rs{i}", "summary": [],
                   "content": [{"type": "reasoning_text", "text": f"Step {i}."}]},
                  {"type": "function_call", "id": f"fc{i}", "call_id": f"c{i}", "name": "bash",
                   "arguments": json.dumps({"command": f"echo {i}"})},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"{i}\n"}]
    return items


def test_responses_history_resumes_after_the_unchanged_prefix():
    first = {"instructions": "Be brief.", "input": _codex_items(3)}
    _, chat, history = responses_api.to_chat_messages(first, None)
    second = {"instructions": "Be brief.", "input": _codex_items(4)}
    assert history.resume("Be brief.", second["input"]) == len(first["input"])
    _, reused, _ = responses_api.to_chat_messages(copy.deepcopy(second), None, history)
    fresh = responses_api.to_chat_messages(second, None)[1]
    assert reused == fresh and all(a is b for a, b in zip(chat, reused))
    edited = copy.deepcopy(second)
    edited["input"][6]["output"] = "changed\n"  # the second call's output, rewritten by the harness
    assert history.resume("Be brief.", edited["input"]) == 4  # back to the end of the first call's output
    assert responses_api.to_chat_messages(edited, None, history)[1] == responses_api.to_chat_messages(edited, None)[1]
    assert history.resume("Other instructions.", second["input"]) == 0
    # mid-assembly of an assistant message (reasoning without its call) is no resume point
    assert history.resume("Be brief.", [*first["input"][:2], {"type": "message", "role": "user", "content": "x"}]) == 1


def test_metrics_give_mismatches_by_type_per_wire_format(codecs):
    asyncio.run(_metrics_per_wire(codecs))


async def _metrics_per_wire(codecs):
    manager, _engine, scripts = make_server(codecs["qwen3"])
    answer = sampled_text("qwen3", content="hi", reasoning="r")
    bodies = {"chat": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [BASH]}),
              "messages": ("messages", {"max_tokens": 32, "messages": [{"role": "user", "content": "hi"}],
                                        "tools": [TOOL]}),
              "responses": ("responses", {"input": "hi", "tools": [FN]})}
    reports = {}
    async with asgi(manager) as http:
        for wire, (route, body) in bodies.items():
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            scripts.add(sid, answer, answer)
            for _ in range(2):
                r = await http.post(f"/sessions/{sid}/v1/{route}", json=body)
                assert r.status_code == 200, r.text
            reports[wire] = (await http.delete(f"/sessions/{sid}?trajectories=true")).json()
        sid = (await http.post("/sessions", json={})).json()["session_id"]  # one session on two routes
        scripts.add(sid, answer, answer)
        for route, body in (bodies["chat"], bodies["messages"]):
            assert (await http.post(f"/sessions/{sid}/v1/{route}", json=body)).status_code == 200
        reports["mixed"] = (await http.delete(f"/sessions/{sid}?trajectories=true")).json()
        metrics = (await http.get("/metrics")).json()
    for wire, report in reports.items():
        assert report["wire"] == wire and report["trajectories"][0]["wire"] == wire
    assert metrics["turns/chat"] == 3 and metrics["turns/messages"] == 3 and metrics["turns/responses"] == 2
    for wire in ("chat", "messages", "responses", "mixed"):
        assert metrics[f"tito_session_mismatch_trajectories/{wire}"] == 1.0
        for kind in ("special_token_count", "special_token_type", "non_assistant_text"):
            assert metrics[f"tito_session_mismatch_rate/{wire}/{kind}"] == 0.0
    assert metrics["tito_session_mismatch_trajectories"] == 4.0


def test_summaries_and_step_metrics_split_by_wire_format():
    def report(kind: str | None) -> dict[str, Any]:
        counts = dict.fromkeys(("special_token_count", "special_token_type", "non_assistant_text",
                                "assistant_text"), 0)
        if kind:
            counts[kind] = 1
        return {"bug": kind not in (None, "assistant_text"), "counts": counts}

    out = summarize_by_wire([("messages", report("non_assistant_text")), ("messages", report(None)),
                             ("chat", report("assistant_text")), (None, report(None))])
    assert out["tito_session_mismatch_trajectories"] == 4.0 and out["tito_session_mismatch_rate"] == 0.25
    assert out["tito_session_mismatch_rate/messages"] == 0.5
    assert out["tito_session_mismatch_rate/messages/non_assistant_text"] == 0.5
    assert out["tito_session_mismatch_rate/chat"] == 0.0 and out["tito_session_mismatch_rate/chat/assistant_text"] == 1.0
    assert "tito_session_mismatch_rate/responses" not in out

    def traj(wire: str, kind: str | None) -> Trajectory:
        t = Trajectory([1, 2], [0, 1], [0.0, -0.1], [None, 0], reward=1.0)
        t.metrics.update({f"tito_mismatch_type/{k}": float(k == kind) for k in ("non_assistant_text", "assistant_text")})
        t.metrics[f"tito_mismatch_wire/{wire}"] = float(kind == "non_assistant_text")
        return t

    m = group_metrics([Group("g", "task", [traj("messages", "non_assistant_text"), traj("responses", None),
                                   traj("responses", "assistant_text"), traj("responses", None)], submitted_version=0)])
    assert m["tito/mismatch_rate/non_assistant_text"] == 0.25 and m["tito/mismatch_rate/assistant_text"] == 0.25
    assert m["tito/mismatch_bug_rate/messages"] == 1.0 and m["tito/mismatch_bug_rate/responses"] == 0.0
