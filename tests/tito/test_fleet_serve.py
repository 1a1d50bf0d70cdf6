"""`miles tito serve --replicas 2`: one session server over a router of two supervised engine
processes, driven by the OpenAI SDK from another process; every engine it launched stops with it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from miles_engine.engines.launch import ServerProcess

REPO = Path(__file__).resolve().parents[2]


def _engine_pids(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"run.engine_server.*{marker}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(240)
def test_session_server_over_two_launched_engines(tmp_path: Path) -> None:
    state = tmp_path / "tmp"
    state.mkdir()
    argv = [sys.executable, "-m", "miles_engine.cli.main", "tito", "serve", "--family", "chatml",
            "--model", "tiny:qwen3", "--tokenizer", "builtin:bpe-chatml", "--replicas", "2",
            "--port", "0", "--port-file", str(tmp_path / "port")]
    env = {**os.environ, "TMPDIR": str(state), "HF_HUB_OFFLINE": "1"}

    async def main() -> None:
        proc = ServerProcess(argv, port_file=tmp_path / "port", cwd=REPO, env=env, name="tito-fleet")
        await proc.start(180)
        try:
            assert len(_engine_pids(str(state))) == 2, proc.log_tail()
            assert "over 2 engine(s)" in proc.log_tail()
            async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
                sessions = [(await http.post("/sessions")).json() for _ in range(4)]

            def converse(base_url: str) -> int:
                client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=60)
                messages = [{"role": "user", "content": "say hi"}]
                sampled = 0
                for _ in range(2):
                    out = client.chat.completions.create(model="policy", messages=messages, max_tokens=8,
                                                         temperature=1.0)
                    sampled += out.usage.completion_tokens
                    messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                                 {"role": "user", "content": "again"}]
                return sampled

            sampled = await asyncio.gather(*(asyncio.to_thread(converse, s["base_url"]) for s in sessions))
            async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
                for s, n in zip(sessions, sampled):
                    report = (await http.get(f"/sessions/{s['session_id']}/trajectories")).json()
                    [traj] = report["trajectories"]  # one linear session, one trajectory
                    assert sum(traj["loss_mask"]) == n  # every sampled token, nothing else
        finally:
            code = await proc.stop(grace_s=20)
        assert code in (0, -15), proc.log_tail()
        for _ in range(50):
            if not _engine_pids(str(state)):
                break
            await asyncio.sleep(0.2)
        assert _engine_pids(str(state)) == [], "an engine process outlived the session server"

    asyncio.run(main())


def test_the_command_line_picks_the_fleet() -> None:
    """--engine-url: external servers (one engine per URL); --engines: any recipe-style list, checked
    like a recipe; --model with --replicas: launched server processes; nothing: one error saying what to give."""
    from miles_engine.errors import ConfigError
    from miles_engine.run.tito_serve import fleet_groups

    [ext] = fleet_groups(None, ["http://127.0.0.1:30000", "http://127.0.0.1:30001"], 1, None)
    assert ext.kind == "external" and ext.replicas == 2 and ext.options["urls"][1].endswith(":30001")
    [srv] = fleet_groups("tiny:qwen3", [], 3, None)
    assert srv.kind == "server" and srv.replicas == 3
    a, b = fleet_groups(None, [], 1, "[{kind: server, replicas: 2, dtype: bfloat16}, {kind: external, "
                                      "options: {urls: ['http://127.0.0.1:1']}}]")
    assert (a.kind, a.replicas, a.dtype, b.kind) == ("server", 2, "bfloat16", "external")
    with pytest.raises(ConfigError) as err:
        fleet_groups(None, [], 1, "[{kind: server, device: gpu}]")
    assert "\n" not in str(err.value) and "bad value for 'engines.0.device' (got 'gpu')" in str(err.value)
    with pytest.raises(ConfigError, match="unknown key 'engines.0.replica'"):
        fleet_groups(None, [], 1, "[{kind: server, replica: 2}]")
    with pytest.raises(ConfigError, match="--model.*--engine-url.*--engines"):
        fleet_groups(None, [], 1, None)
