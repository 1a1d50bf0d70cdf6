"""Test kit for the NeMo Gym plugin: dataset rows, the resources server command, a scripted agent."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext

HERE = Path(__file__).resolve().parent
TOOLS = [
    {"type": "function", "name": "get_secret", "description": "Read this session's secret number.",
     "parameters": {"type": "object", "properties": {}, "additionalProperties": False}, "strict": True},
    {"type": "function", "name": "multiply", "description": "Multiply two numbers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                    "required": ["a", "b"], "additionalProperties": False}, "strict": True},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "nemo_gym_resources_server:app",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def make_row(index: int, secret: int, factor: int = 7, **extra: object) -> dict:
    return {
        "id": f"q{index}",
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "Use the tools. Answer with the number only."},
                {"role": "user", "content": [{"type": "input_text", "text": f"Multiply your secret by {factor}."}]},
            ],
            "tools": TOOLS,
        },
        "secret": secret,
        "factor": factor,
        "expected_answer": str(secret * factor),
        **extra,
    }


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path



class SecretTimesFactorAgent:
    """get_secret, multiply by the row's factor, answer the product (``wrong``: answer product + 1)."""

    name = "scripted-secret"

    def __init__(self, *, wrong: bool = False) -> None:
        self.wrong = wrong

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        secret = await ctx.call_tool("get_secret", {})
        if secret.is_error:
            return AgentResult(turns=1, stop_reason="error", info={"error": secret.content})
        factor = ctx.task.row.data["factor"]
        product = await ctx.call_tool("multiply", {"a": json.loads(secret.content)["secret"], "b": factor})
        answer = json.loads(product.content)["product"] if not product.is_error else "?"
        ctx.say(str(answer + 1 if self.wrong else answer))
        return AgentResult(turns=3)
