"""A training run exposes its session server: at the port the recipe asks (loopback by default),
its URL written to RUN_DIR/session_server.url, so a harness in another process (here the OpenAI
SDK in a thread, over a real socket) opens sessions and chats with the run's engines."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import openai
import pytest

from miles_engine.config.recipe import load_recipe
from miles_engine.run.compose import compose
from miles_engine.hub import default_hub


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_run_serves_sessions_to_a_harness_in_another_process(tmp_path: Path) -> None:
    port = _free_port()
    cfg = load_recipe("tiny-terminal", ["sft.enabled=false", "tokenizer.corpus_demos=200", "rollout.mode=sync",
                                        "placement.trainer=in_process", f"session_server.port={port}"],
                      hub=default_hub())
    run_dir = tmp_path / "run"

    def harness(url: str) -> tuple[int, dict]:
        with httpx.Client(base_url=url, timeout=30) as http:
            session = http.post("/sessions").json()
        client = openai.OpenAI(base_url=session["base_url"], api_key="sk-test", max_retries=0, timeout=60)
        out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4)
        with httpx.Client(base_url=url, timeout=30) as http:
            report = http.get(f"/sessions/{session['session_id']}/trajectories").json()
        return out.usage.completion_tokens, report

    async def main() -> None:
        async with compose(cfg, run_dir, hub=default_hub()) as parts:
            url = (run_dir / "session_server.url").read_text().strip()
            assert url == f"http://127.0.0.1:{port}" == parts.server.url
            sampled, report = await asyncio.to_thread(harness, url)
            assert sampled >= 1 and sum(report["trajectories"][0]["loss_mask"]) == sampled
        assert not (run_dir / "session_server.url").exists()  # gone with the run

    asyncio.run(asyncio.wait_for(main(), 300))
