"""One shell drill as a miles task: setup files, the bash tool, reference solution, verifier.

Scoring (reward 1.0 or 0.0; ``components`` adds ``used_tool``):

- ``echo``: the **first** bash call of the episode must print the word: its stdout, stripped,
  equals the word. Later calls do not count (a drill is one command, not trial and error), and
  answering without calling bash scores 0. The stdout is the one the sandbox returned for that
  call (recorded by :meth:`DrillTask.call_tool`; for a transcript without those records the
  first tool message's content is used).
- ``write-file``: the file, read back from the sandbox, holds exactly the word (one trailing
  newline allowed).
- ``calc`` / ``count`` / ``grep``: the final assistant message, stripped, equals the answer
  exactly (``calc`` additionally requires a bash call when ``calc_require_tool`` is set).
"""

from __future__ import annotations

import random
from typing import Any

from miles_engine.environments.base import SandboxTask
from miles_engine.environments.protocol import EpisodeContext, Message, RewardResult, TaskLimits, ToolResult
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec

from miles_env_terminal_tasks.drills import demos
from miles_env_terminal_tasks.drills.kinds import ANSWER_KINDS, SYSTEM_PROMPT, Instance
from miles_env_terminal_tasks.drills.options import DrillOptions

WORKDIR = "/app"
CALLS_KEY = "drill_calls"


class DrillTask(SandboxTask):
    """A generated drill. Build it through :class:`~miles_env_terminal_tasks.drills.source.ShellDrillsSource`."""

    def __init__(self, task_id: str, instance: Instance, options: DrillOptions, *, source: str = "shell-drills"):
        limits = TaskLimits(
            agent_timeout_s=60.0,
            verifier_timeout_s=30.0,
            max_turns=options.max_turns,
            command_timeout_s=options.command_timeout_s,
        )
        metadata = {"source": source, "kind": instance.kind, "difficulty": instance.difficulty,
                    "tags": ["drill", instance.kind], "seed": options.seed}
        super().__init__(task_id, limits=limits, metadata=metadata)
        self.instance = instance
        self.options = options
        self.source = source

    @property
    def kind(self) -> str:
        return self.instance.kind

    def prompt(self) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.instance.instruction}]

    def sandbox_spec(self) -> SandboxSpec:
        return SandboxSpec(
            workdir=WORKDIR,
            paths=(WORKDIR,),
            network=NetworkPolicy(mode="none"),
            labels={"miles.source": self.source, "miles.task": self.id},
        )

    async def setup(self, ctx: EpisodeContext) -> None:
        ctx.info[CALLS_KEY] = []
        if ctx.sandbox is not None:
            for name, text in self.instance.files.items():
                await ctx.sandbox.write_file(f"{WORKDIR}/{name}", text)

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        result = await super().call_tool(ctx, name, arguments)
        run = result.exec_result
        ctx.info.setdefault(CALLS_KEY, []).append({
            "tool": name,
            "command": arguments.get("command") if isinstance(arguments, dict) else None,
            "stdout": run.stdout if run is not None else None,
            "exit_code": run.exit_code if run is not None else None,
        })
        return result

    async def solve(self, ctx: EpisodeContext) -> None:
        result = await ctx.call_tool("bash", {"command": self.instance.reference_command})
        if self.kind in ANSWER_KINDS:
            out = result.exec_result.stdout if result.exec_result is not None else result.content
            ctx.say(out.strip())
        else:
            ctx.say(self.instance.params["word"] if self.kind == "echo" else "done")

    # -- verification ------------------------------------------------------------------
    def _bash_calls(self, ctx: EpisodeContext) -> list[str | None]:
        """Stdout of each bash call in order (``None`` when the call did not run)."""
        calls = ctx.info.get(CALLS_KEY)
        if calls:
            return [c["stdout"] for c in calls if c["tool"] == "bash"]
        names = {}
        for msg in ctx.transcript:  # fall back to the transcript (e.g. a replayed conversation)
            for call in msg.get("tool_calls") or []:
                names[call.get("id")] = (call.get("function") or {}).get("name")
        return [m.get("content") for m in ctx.transcript
                if m.get("role") == "tool" and names.get(m.get("tool_call_id")) == "bash"]

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        outputs = self._bash_calls(ctx)
        used_tool = 1.0 if outputs else 0.0
        inst = self.instance
        info: dict[str, Any] = {"kind": inst.kind, "bash_calls": len(outputs)}
        if inst.kind == "echo":
            first = outputs[0] if outputs else None
            ok = first is not None and first.strip() == inst.params["word"]
            info["printed"] = None if first is None else first.strip()[:200]
        elif inst.kind == "write-file":
            ok, info["file"] = await self._file_holds_word(ctx)
        else:
            answer = ctx.last_assistant_text()
            info["answer"] = None if answer is None else answer[:200]
            ok = answer is not None and answer.strip() == inst.answer
            if inst.kind == "calc" and self.options.calc_require_tool and not outputs:
                ok = False
        return RewardResult(reward=1.0 if ok else 0.0, components={"used_tool": used_tool}, info=info)

    async def _file_holds_word(self, ctx: EpisodeContext) -> tuple[bool, str]:
        if ctx.sandbox is None:
            return False, "no sandbox"
        path = f"{WORKDIR}/{self.instance.params['path']}"
        check = await ctx.sandbox.exec(f"test -f {path}", timeout_s=10)
        if not check.ok:
            return False, "missing"
        data = await ctx.sandbox.read_file(path, max_bytes=4096)
        word = self.instance.params["word"].encode()
        return data in (word, word + b"\n"), data[:80].decode("utf-8", "replace")

    # -- demonstrations ------------------------------------------------------------------
    def demonstration(self, rng: random.Random, wrong: bool) -> list[Message]:
        """The assistant-side turns of one right or deliberately wrong attempt (no sandbox needed)."""
        return self.attempt(rng, wrong).messages()

    def attempt(self, rng: random.Random, wrong: bool) -> demos.Attempt:
        return demos.attempt(self.instance, rng, self.options.word_pool(), wrong=wrong,
                             no_tool_share=self.options.demo_no_tool_share)
