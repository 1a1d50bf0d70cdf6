"""What the harness-agent tests share, on any sandbox backend: a minimal custom harness (stdlib
Python, chat completions with one bash tool, as an agent would) that first runs a probe of what
it must not reach, and the checks of one scripted session (the policy calls the tool once, then
answers)."""

from __future__ import annotations

import os

import pytest

from miles_engine.tito.harness import default_harness_dir

_AGENT_LOOP = r"""tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
        "properties": {"command": {"type": "string"}}}}}
msgs = [{"role": "user", "content": os.environ["MILES_TASK_PROMPT"]}]
for _ in range(4):
    req = urllib.request.Request(base, json.dumps({"messages": msgs, "tools": [tool]}).encode(),
                                 {"content-type": "application/json"})
    msg = json.load(urllib.request.urlopen(req))["choices"][0]["message"]
    msgs.append(msg)
    if not msg.get("tool_calls"):
        break
    for call in msg["tool_calls"]:
        cmd = json.loads(call["function"]["arguments"])["command"]
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True).stdout
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": out})
print(msgs[-1]["content"])
"""


def harness_bin(name: str, harness_dir: str | None = None) -> str | None:
    """The installed CLI ``name`` (``claude``, ``codex``), or None."""
    path = os.path.join(harness_dir or default_harness_dir(), "node_modules", ".bin", name)
    return path if os.access(path, os.X_OK) else None


def custom_harness(probe: str) -> str:
    """The harness command: ``probe`` (Python run first, with ``json os socket subprocess
    urllib.request`` imported and ``base`` set to the session's chat completions URL), then the
    agent loop, which prints the final answer."""
    return ("\npython3 - <<'EOF'\nimport json, os, socket, subprocess, urllib.request\n"
            'base = os.environ["MILES_SESSION_URL"] + "/v1/chat/completions"\n'
            + probe.strip("\n") + "\n" + _AGENT_LOOP + "EOF\n")


def check_one_exact_session(summary: dict) -> None:
    """One scripted session ended well: the tool ran in the sandbox, one exact trajectory of two
    turns, no non-assistant or special-token mismatch, every sampled token counted."""
    assert summary["stop"] == "done", summary
    assert summary["tool_ran"], summary  # the policy's tool call ran inside the sandbox
    assert summary["trajectories"] == 1 and summary["forks"] == 0
    assert summary["turns"] == 2 and summary["generations"] == 2
    assert summary["mismatch"]["non_assistant_text"] == 0
    assert summary["mismatch"]["special_token_count"] == summary["mismatch"]["special_token_type"] == 0
    assert summary["sampled_tokens"] == sum(t["completion_tokens"] for t in summary["per_turn"])


def require_harness_cli(binary: str) -> None:
    """Skip, naming why, when a real harness CLI is not installed."""
    if harness_bin(binary) is None:
        pytest.skip(f"{binary} not installed in {default_harness_dir()} (run scripts/install_harnesses.sh; "
                    "needs node/npm and the npm registry)")
