"""Multi-step Harbor tasks (``[[steps]]``), run as Harbor's ``MultiStepTrial`` runs them.

The steps run in order in ONE sandbox. Each step has ``steps/<name>/instruction.md``, its own
tests (``steps/<name>/tests/`` copied into ``/tests`` over the task's shared ``tests/``; its
``test.sh`` wins, else the shared one), an optional ``solution/solve.sh`` and an optional
``workdir/`` (uploaded into the working directory before the step, its ``setup.sh`` run there).

In a miles episode the agent gets the first step's instruction as its prompt. When it ends its
turn (answers without a tool call), the task verifies that step and — unless the episode stops
there — answers with the next step's instruction as the next user message of the same
conversation (:meth:`EpisodeContext.next_turn`). Each step has its own agent time
(``[steps.agent].timeout_sec``, else ``[agent]``): past it the step's tool calls are refused.
When the agent stops for good (no next turn taken: done, ``max_turns``, timeout), the episode's
verification verifies the step it was on and every later step in turn, as Harbor does for an
agent that does nothing more.

As in Harbor, a step whose verifier gives no reward (a crash, no reward file) or whose rewards
fall below its ``min_reward`` ends the episode: later steps are not run. The episode reward is
``multi_step_reward_strategy``: ``mean`` (the default) — per reward key, the mean over the steps
that have a reward (a key a step lacks counts 0) — or ``final`` — the last run step's rewards.
The scalar is then taken from that map as for a single-step task; every step's rewards are kept
in the components as ``steps.<name>.<key>``.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_engine.environments.protocol import EpisodeContext, Message, NoReferenceSolution, RewardResult

from miles_env_harbor import verifier
from miles_env_harbor.artifacts import gather_artifacts
from miles_env_harbor.config import StepSection, TaskConfig, resolve_env
from miles_env_harbor.rewards import scalar_reward

if TYPE_CHECKING:
    from miles_env_harbor.task import HarborTask

STATE_KEY = "harbor_steps"
SETUP_TIMEOUT_S = 600.0


def agent_timeout(config: TaskConfig, step: StepSection) -> float:
    return step.agent.timeout_sec or config.agent.timeout_sec


def verifier_timeout(config: TaskConfig, step: StepSection) -> float:
    return step.verifier.timeout_sec or config.verifier.timeout_sec


@dataclass
class StepOutcome:
    name: str
    rewards: dict[str, float] | None = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rewards": self.rewards, "error": self.error, **self.info}


@dataclass
class StepsState:
    """One episode's progress through the steps (kept in ``ctx.info``: a task serves many episodes)."""

    index: int = 0
    deadline: float = float("inf")  # time.monotonic() past which the current step's tool calls are refused
    verified: bool = False  # the current step has been verified
    stopped: str | None = None  # why the episode ends early
    outcomes: list[StepOutcome] = field(default_factory=list)
    artifacts: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": [o.to_dict() for o in self.outcomes]}
        if self.stopped:
            out["stopped"] = self.stopped
        if self.artifacts:
            out["artifacts"] = self.artifacts
        return out


def state(ctx: EpisodeContext) -> StepsState:
    found = ctx.info.get(STATE_KEY)
    if not isinstance(found, StepsState):
        found = ctx.info[STATE_KEY] = StepsState()
    return found


def close(ctx: EpisodeContext) -> None:
    """Leave a plain summary in ``ctx.info`` (also when the episode ended before verification)."""
    found = ctx.info.get(STATE_KEY)
    if isinstance(found, StepsState):
        ctx.info[STATE_KEY] = found.to_dict()


def current(task: HarborTask, ctx: EpisodeContext) -> StepSection:
    return task.steps[state(ctx).index]


def instruction_message(task: HarborTask, index: int) -> Message:
    return {"role": "user", "content": task.step_instructions[index]}


async def begin(task: HarborTask, ctx: EpisodeContext, index: int) -> None:
    """Move to step ``index``: upload its ``workdir/`` and run its ``setup.sh``; a failure ends the episode."""
    st = state(ctx)
    st.index, st.verified = index, False
    step = task.steps[index]
    st.deadline = time.monotonic() + agent_timeout(task.config, step)
    workdir = task.step_dir(step.name) / "workdir"
    if ctx.sandbox is None or not workdir.is_dir():
        return
    try:
        error = await _prepare_workdir(task, ctx, step, workdir)
    except Exception as exc:
        error = f"cannot prepare steps/{step.name}/workdir: {type(exc).__name__}: {exc}"
    if error is not None:
        st.verified = True
        st.outcomes.append(StepOutcome(step.name, error=error))
        st.stopped = f"step '{step.name}' setup failed"
        st.deadline = float("-inf")


async def _prepare_workdir(task: HarborTask, ctx: EpisodeContext, step: StepSection, workdir: Path) -> str | None:
    """Upload the step's ``workdir/`` and run its ``setup.sh``; what went wrong, or ``None``."""
    assert ctx.sandbox is not None
    await ctx.sandbox.upload_dir(workdir, task.workdir)
    if not (workdir / "setup.sh").is_file():
        return None
    script = f"{task.workdir.rstrip('/')}/setup.sh"
    user = step.agent.user if step.agent.user is not None else task.config.agent.user
    result = await ctx.sandbox.exec(f"bash {shlex.quote(script)}", timeout_s=SETUP_TIMEOUT_S,
                                    **({"user": str(user)} if user is not None else {}))
    if result.ok:
        return None
    why = "timed out" if result.timed_out else f"exited with code {result.exit_code}"
    return f"steps/{step.name}/workdir/setup.sh {why}: {(result.stderr or result.stdout).strip()[-500:]}"


def step_test_plan(task: HarborTask, step: StepSection) -> verifier.TestPlan:
    step_tests = task.step_dir(step.name) / "tests"
    dirs = tuple(d for d in (task.tests_dir, step_tests) if d.is_dir())
    own = (step_tests / "test.sh").is_file()
    user = step.verifier.user if step.verifier.user is not None else task.config.verifier.user
    return verifier.TestPlan(
        tests_dirs=dirs, script=f"steps/{step.name}/tests/test.sh" if own else "tests/test.sh",
        env={**task.config.verifier.env, **step.verifier.env},
        env_where=f"{task.toml_path} [verifier].env / [steps.verifier].env of step '{step.name}'",
        timeout_s=verifier_timeout(task.config, step), user=user, clear_tests=True,
    )


async def verify_current(task: HarborTask, ctx: EpisodeContext) -> None:
    """Verify the current step (once), record its outcome and whether the episode stops here."""
    st = state(ctx)
    if st.verified:
        return
    step = task.steps[st.index]
    if ctx.sandbox is None:
        result = RewardResult.failed("no sandbox to verify in")
    else:
        try:
            result = await verifier.run_tests(task, ctx.sandbox, step_test_plan(task, step))
        except Exception as exc:  # as Harbor: a crashed verifier is this step's error; the others stand
            result = RewardResult.failed(f"task '{task.id}': verifier of step '{step.name}' failed: "
                                         f"{type(exc).__name__}: {exc}")
    st.verified = True
    rewards = dict(result.components) if result.reward is not None else None
    info = {k: v for k, v in result.info.items() if k in ("test_exit_code", "test_duration_s", "test_stdout_tail")}
    st.outcomes.append(StepOutcome(step.name, rewards=rewards, error=result.error, info=info))
    if ctx.sandbox is None:
        st.stopped = f"step '{step.name}' gave no reward"
        return
    artifacts = [*task.config.artifacts, *step.artifacts]
    gathered = await gather_artifacts(ctx.sandbox, artifacts, where=f"task '{task.id}' step '{step.name}'",
                                      prefix=f"steps/{step.name}/")
    if gathered.files or gathered.missing or gathered.errors or gathered.skipped:
        st.artifacts[step.name] = gathered.to_info()
    if rewards is None:
        st.stopped = f"step '{step.name}' gave no reward"
    elif why := step.min_reward_failure(rewards):
        st.stopped = f"step '{step.name}': {why}"


async def next_turn(task: HarborTask, ctx: EpisodeContext) -> list[Message] | None:
    """The agent ended its turn: verify the step and hand it the next one's instruction, if any."""
    st = state(ctx)
    await verify_current(task, ctx)
    if st.stopped or st.index + 1 >= len(task.steps):
        return None
    await begin(task, ctx, st.index + 1)
    if st.stopped:
        return None
    return [instruction_message(task, st.index)]


def step_time_left(ctx: EpisodeContext) -> float:
    return state(ctx).deadline - time.monotonic()


async def solve(task: HarborTask, ctx: EpisodeContext) -> None:
    """The oracle's move for the current step: run ``steps/<name>/solution/solve.sh`` when the step has one."""
    if not task.has_reference_solution:
        raise NoReferenceSolution(f"task '{task.id}' has no reference solution (no steps/<name>/solution/solve.sh "
                                  f"under {task.task_dir})")
    if ctx.sandbox is None:
        raise RuntimeError(f"task '{task.id}': the reference solution needs a sandbox")
    st = state(ctx)
    if st.stopped:
        return
    step = task.steps[st.index]
    solution = task.step_dir(step.name) / "solution"
    if not (solution / "solve.sh").is_file():
        _record_solution(ctx, step.name, {"skipped": f"no steps/{step.name}/solution/solve.sh"})
        return
    env = resolve_env(task.config.solution.env, where=f"{task.toml_path} [solution].env")
    clear = await ctx.sandbox.exec("mkdir -p /solution && find /solution -mindepth 1 -delete", timeout_s=30)
    if not clear.ok:
        raise RuntimeError(f"task '{task.id}': cannot empty /solution: {(clear.stderr or clear.stdout).strip()}")
    await ctx.sandbox.upload_dir(solution, "/solution")
    user = step.agent.user if step.agent.user is not None else task.config.agent.user
    result = await ctx.sandbox.exec("bash /solution/solve.sh", env=env or None,
                                    timeout_s=agent_timeout(task.config, step),
                                    **({"user": str(user)} if user is not None else {}))
    _record_solution(ctx, step.name, {"exit_code": result.exit_code, "timed_out": result.timed_out,
                                      "output_tail": (result.stdout + result.stderr)[-2000:]})


def _record_solution(ctx: EpisodeContext, name: str, entry: dict[str, Any]) -> None:
    """``ctx.info["solution"]`` in the single-step shape (the first failing step's exit code, any
    time-out, the tails by step) with each step's own record under ``steps``."""
    solution = ctx.info.setdefault("solution", {"steps": {}})
    solution["steps"][name] = entry
    ran = {n: e for n, e in solution["steps"].items() if "exit_code" in e}
    if not ran:
        return
    failed = [e["exit_code"] for e in ran.values() if e["exit_code"] != 0]
    solution["exit_code"] = failed[0] if failed else 0
    solution["timed_out"] = any(e["timed_out"] for e in ran.values())
    solution["output_tail"] = "".join(f"[{n}] {e['output_tail']}" for n, e in ran.items())[-2000:]


def aggregate(outcomes: list[StepOutcome], strategy: str) -> dict[str, float] | None:
    """Harbor's episode rewards from the steps' (see the module docstring)."""
    if strategy == "final":
        return outcomes[-1].rewards if outcomes else None
    scored = [o.rewards for o in outcomes if o.rewards is not None]
    keys = sorted({k for rewards in scored for k in rewards})
    if not keys:
        return None
    return {k: sum(r.get(k, 0.0) for r in scored) / len(scored) for k in keys}


async def verify(task: HarborTask, ctx: EpisodeContext) -> RewardResult:
    """The episode's verdict: the current step and every later one verified, then aggregated."""
    st = state(ctx)
    await verify_current(task, ctx)
    while not st.stopped and st.index + 1 < len(task.steps):
        await begin(task, ctx, st.index + 1)
        if not st.stopped:
            await verify_current(task, ctx)
    summary = st.to_dict()
    rewards = aggregate(st.outcomes, task.config.reward_strategy)
    info = {"reward_strategy": task.config.reward_strategy, **summary}
    if rewards is None:
        errors = "; ".join(f"step '{o.name}': {o.error}" for o in st.outcomes if o.error) or "no step was verified"
        return RewardResult.failed(f"task '{task.id}': no step reward to aggregate "
                                   f"({task.config.reward_strategy}): {errors}", **info)
    tails = "".join(f"[{o.name}] {o.info['test_stdout_tail']}" for o in st.outcomes if o.info.get("test_stdout_tail"))
    if tails:  # the why of a partial score, for the logs (as a single-step task gives it)
        info["test_stdout_tail"] = tails[-2000:]
    components = dict(rewards)
    for outcome in st.outcomes:
        for key, value in (outcome.rewards or {}).items():
            components[f"steps.{outcome.name}.{key}"] = value
    return RewardResult(reward=scalar_reward(rewards), components=components, info=info)


def validate_layout(task_dir: Path, config: TaskConfig) -> list[str]:
    """What a multi-step task directory lacks, as Harbor's ``Task`` checks it."""
    problems: list[str] = []
    shared_test = (task_dir / "tests" / "test.sh").is_file()
    for step in config.steps or []:
        step_dir = task_dir / "steps" / step.name
        if not step_dir.is_dir():
            problems.append(f"steps/{step.name}/ (the directory of step '{step.name}')")
            continue
        if not (step_dir / "instruction.md").is_file():
            problems.append(f"steps/{step.name}/instruction.md")
        if not shared_test and not (step_dir / "tests" / "test.sh").is_file():
            problems.append(f"steps/{step.name}/tests/test.sh (or a shared tests/test.sh)")
    return problems
