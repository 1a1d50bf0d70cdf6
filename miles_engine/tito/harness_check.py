"""``miles tito check-harness``: drive a harness through N sessions with a scripted policy and
report, per turn, how the server matched what the harness re-sent.

The policy (:func:`tool_then_answer`) answers each turn from the prompt it gets: a call of the
harness's shell tool (``exec_command`` for Codex, ``Bash`` for Claude Code, else ``bash`` /
``shell``) running ``command`` while the last turn holds no tool result, then a final answer.
Per session the report has the trajectories (one per linear session), each turn's token
accounting and the diagnostic's mismatch counts by type; a *fork* is a generation that did not
extend the previous one (a retry, or a branch when the harness rewrote its history).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles_engine.engines.protocol import GenerateRequest
from miles_engine.engines.scripted import ScriptedEngine
from miles_engine.environments.protocol import RewardResult, TaskLimits
from miles_engine.rollout.episode import run_episode
from miles_engine.sandbox.protocol import SandboxSpec
from miles_engine.tito import make_codec
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.service import SessionManager, SessionServerConfig

if TYPE_CHECKING:
    from miles_engine.hub import Hub

SHELL_TOOLS = (("exec_command", "cmd"), ("Bash", "command"), ("bash", "command"), ("shell", "command"))
ANSWER = "Done: the command ran."


def tool_then_answer(codec: ChatCodec, command: str = "echo miles > miles.txt && cat miles.txt",
                     answer: str = ANSWER) -> Any:
    """A reply function for :class:`~miles_engine.engines.scripted.ScriptedEngine` (Hermes
    ``<tool_call>`` families: qwen3, chatml)."""
    tok = codec.tokenizer
    think = "<think>\nRun it.\n</think>\n\n" if codec.family.has_reasoning else ""
    done = "<think>\nReport.\n</think>\n\n" if codec.family.has_reasoning else ""

    def reply(ids: Sequence[int], _req: GenerateRequest) -> str:
        text = tok.decode(list(ids))
        turn = text.rsplit("<|im_start|>assistant", 1)[0].rsplit("<|im_start|>user", 1)[-1]
        if "<tool_response>" in turn:
            return f"{done}{answer}<|im_end|>"
        name, arg = next(((n, a) for n, a in SHELL_TOOLS if f'"name": "{n}"' in text), SHELL_TOOLS[-2])
        call = json.dumps({"name": name, "arguments": {arg: command}})
        return f"{think}<tool_call>\n{call}\n</tool_call><|im_end|>"

    return reply


def session_summary(report: dict[str, Any], generations: int) -> dict[str, Any]:
    """Per-turn accounting of one collected session (``generations``: engine calls it made)."""
    trajs = report.get("trajectories", [])
    turns = [t for traj in trajs for t in traj["turns"]]
    counts: dict[str, int] = {}
    for traj in trajs:
        for kind, n in (traj.get("tito_session_mismatch") or {}).get("counts", {}).items():
            counts[kind] = counts.get(kind, 0) + n
    return {
        "trajectories": len(trajs),
        "turns": len(turns),
        "generations": generations,
        "forks": generations - len({t["node_id"] for t in turns}),
        "sampled_tokens": sum(sum(t["loss_mask"]) for t in trajs),
        "per_turn": [{"turn": i + 1, "completion_tokens": t["completion_end"] - t["completion_start"],
                      "env_tokens": t["completion_start"] - t["prompt_start"], "finish": t["finish_reason"]}
                     for i, t in enumerate(turns)],
        "mismatch": counts,
    }


async def check_harness(command: str, *, sessions: int = 2, preset: str = "custom", family: str = "qwen3",
                        tokenizer: str | None = None, timeout_s: float = 300.0, backend: str = "local",
                        backend_options: dict[str, Any] | None = None,
                        tool_command: str = "echo miles > miles.txt && cat miles.txt",
                        env: dict[str, str] | None = None, hub: Hub) -> list[dict[str, Any]]:
    """Run the harness agent ``sessions`` times in sandboxes of ``backend`` against a scripted policy
    (docker: image ubuntu:24.04, which the engine's image map may stand in for)."""
    from miles_engine.tito.harness import HarnessAgent, HarnessAgentOptions
    from miles_engine.tito.server import ServerThread, create_app

    spec = tokenizer or ("builtin:qwen3" if family == "qwen3" else f"builtin:bpe-{family}")
    codec = make_codec(family, spec, hub=hub)
    engine = ScriptedEngine(codec.tokenizer, tool_then_answer(codec, tool_command), canonical=False)
    manager = SessionManager(engine, codec, SessionServerConfig())
    sandboxes = hub.create("sandbox", backend, backend_options or {}, where="check-harness sandbox options")
    task = _ShellTask(TaskLimits(agent_timeout_s=timeout_s, verifier_timeout_s=10, max_turns=8),
                      image="ubuntu:24.04" if backend == "docker" else None)
    server = ServerThread(create_app(manager))
    url = server.start()
    out = []
    try:
        for _ in range(sessions):
            opts = HarnessAgentOptions(preset=preset, command=command if preset == "custom" else None,  # type: ignore[arg-type]
                                       server_url=url, env=dict(env or {}))
            before = len(engine.requests)
            result = await run_episode(task, HarnessAgent(opts), sandboxes)
            info = result.agent.info
            calls = len(engine.requests) - before
            summary = session_summary({"trajectories": info.get("trajectories", [])}, calls)
            summary.update(stop=result.agent.stop_reason, error=info.get("error"),
                           tool_ran=result.reward.reward == 1.0, stdout_tail=info.get("stdout_tail", ""))
            out.append(summary)
    finally:
        await asyncio.to_thread(server.stop)
        aclose = getattr(sandboxes, "aclose", None)
        if aclose is not None:
            await aclose()
    return out


class _ShellTask:
    """Reward 1 iff the policy's tool call ran in the sandbox (``miles.txt`` holds ``miles``)."""

    id = "check-harness"
    metadata: dict[str, Any] = {}

    def __init__(self, limits: Any, image: str | None = None) -> None:
        self.limits, self.image = limits, image

    def prompt(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Write the word miles to miles.txt with your shell tool."}]

    def sandbox_spec(self) -> Any:
        return SandboxSpec(image=self.image)

    def tools(self) -> list[Any]:
        return []

    async def setup(self, ctx: Any) -> None: ...

    async def call_tool(self, ctx: Any, name: str, arguments: dict[str, Any]) -> Any:
        raise RuntimeError("the harness runs its own tools")

    async def solve(self, ctx: Any) -> None: ...

    async def verify(self, ctx: Any) -> Any:
        data = await ctx.sandbox.exec("cat miles.txt 2>/dev/null")
        return RewardResult(reward=1.0 if data.stdout.strip() == "miles" else 0.0)

    async def teardown(self, ctx: Any) -> None: ...
