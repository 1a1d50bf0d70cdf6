"""An eval attempt that errors is an error, never a zero; the evaluator's queue skips or waits."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from miles_engine.agents.builtin import NopAgent
from miles_engine.environments.protocol import EpisodeContext, RewardResult, TaskLimits, TaskRef
from miles_engine.evaluation.config import EvalConfig
from miles_engine.evaluation.evaluator import Evaluator, _Job
from miles_engine.evaluation.external import parse_result
from miles_engine.evaluation.runner import eval_path, read_records, run_eval, summary_metrics, write_records
from miles_engine.evaluation.splits import EvalTasks
from miles_engine.hub import default_hub


class ScriptedTask:
    """A sandbox-less task whose setup / verifier does what its id says."""

    def __init__(self, task_id: str) -> None:
        self.id, self.limits, self.metadata = task_id, TaskLimits(verifier_timeout_s=5), {}

    def prompt(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "hi"}]

    def sandbox_spec(self) -> None:
        return None

    def tools(self) -> list[Any]:
        return []

    async def setup(self, ctx: EpisodeContext) -> None:
        if self.id == "setup-fails":
            raise OSError("no such image")

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError

    async def solve(self, ctx: EpisodeContext) -> None:
        return None

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        if self.id == "verifier-raises":
            raise RuntimeError("verifier crashed")
        if self.id == "no-reward":
            return RewardResult.failed("tests did not run")
        if self.id == "slow":
            await asyncio.sleep(30)
        return RewardResult(reward={"pass": 1.0, "fail": 0.0, "half": 0.5}.get(self.id, 0.0))

    async def teardown(self, ctx: EpisodeContext) -> None:
        return None


class ScriptedSource:
    name = "scripted"

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    def list_tasks(self) -> Any:
        return iter(TaskRef(id=i) for i in self.ids)

    def load_task(self, task_id: str) -> ScriptedTask:
        return ScriptedTask(task_id)


def test_errored_attempts_are_counted_by_kind_and_never_scored() -> None:
    ids = ["pass", "fail", "verifier-raises", "no-reward", "setup-fails", "slow"]
    cfg = EvalConfig(attempts=2, pass_k=[1, 2], timeout_s=1.0, jobs=16)
    records = asyncio.run(run_eval(EvalTasks(ScriptedSource(ids), ids, "none", len(ids)), NopAgent, None, cfg))
    kinds = {r.task_id: r.error_kind for r in records}
    assert kinds == {"pass": None, "fail": None, "verifier-raises": "verifier", "no-reward": "verifier",
                     "setup-fails": "setup", "slow": "timeout"}
    assert all(r.reward is None and r.passed is None for r in records if r.error_kind)
    m = summary_metrics(records, cfg)
    assert m["eval/reward"] == 0.5 and m["eval/pass@1"] == 0.5 and m["eval/tasks_scored"] == 2  # not 1/6
    assert (m["eval/errors"], m["eval/errors/verifier"], m["eval/errors/setup"], m["eval/errors/timeout"]) == (8, 4, 2, 2)
    assert (m["eval/attempts"], m["eval/scored"], m["eval/tasks"]) == (12, 4, 6)


def test_records_round_trip_through_the_step_file(tmp_path: Path) -> None:
    ids = ["pass", "half", "no-reward"]
    records = asyncio.run(run_eval(EvalTasks(ScriptedSource(ids), ids, "none", 3), NopAgent, None, EvalConfig()))
    path = write_records(eval_path(tmp_path, 7), records, step=7, weight_version=3)
    assert path.name == "step_000007.jsonl" and read_records(path) == records
    assert not list(path.parent.glob(".*.tmp"))


def test_external_result_errors_are_not_zeros() -> None:
    records, metrics = parse_result({"tasks": [{"task_id": "a", "reward": 1.0}, {"task_id": "b", "reward": 0.0},
                                               {"task_id": "c", "error": "container died"},
                                               {"task_id": "d", "reward": None}],
                                     "metrics": {"accuracy": 0.5, "note": "text is ignored"}}, 1.0)
    m = summary_metrics(records, EvalConfig())
    assert m["eval/reward"] == 0.5 and m["eval/errors/external"] == 2
    assert metrics == {"eval/external/accuracy": 0.5}


def _slow_jobs(done: list[int], release: asyncio.Event) -> Any:
    async def prepare(step: int, version: int) -> _Job:
        async def run() -> tuple[list[Any], dict[str, float]]:
            await release.wait()
            done.append(step)
            return [], {"eval/custom": float(step)}
        return _Job(step, version, run, 0.0)
    return prepare


@pytest.mark.parametrize("overflow", ["skip", "backpressure"])
def test_queue_overflow_skips_or_waits(tmp_path: Path, overflow: str) -> None:
    async def scenario() -> tuple[Evaluator, list[int], list[int]]:
        done: list[int] = []
        release = asyncio.Event()
        cfg = EvalConfig(every=1, queue_size=1, overflow=overflow, at_start=False)
        logged: list[int] = []
        ev = Evaluator(cfg, tmp_path, prepare=_slow_jobs(done, release), inline=False,
                       log_metrics=lambda step, m, kind: logged.append(step), current_step=lambda: 4)
        for step in (1, 2):  # 1 runs (blocked), 2 waits in the queue
            await ev.after_step(step, step)
            await asyncio.sleep(0)
        third = asyncio.create_task(ev.after_step(3, 3))
        await asyncio.sleep(0.05)
        blocked = not third.done()
        release.set()
        await third
        await ev.aclose()
        assert blocked == (overflow == "backpressure")
        return ev, done, logged

    ev, done, logged = asyncio.run(scenario())
    if overflow == "skip":
        assert done == [1, 2] and ev.skipped == 1
    else:
        assert done == [1, 2, 3] and ev.skipped == 0
    assert logged == done and all(row["eval/lag_steps"] == 4 - row["step"] for row in ev.rows)
    assert all(row["eval/weight_version"] == row["step"] and not math.isnan(row["eval/seconds"]) for row in ev.rows)


def test_a_failing_evaluation_is_logged_and_does_not_raise(tmp_path: Path) -> None:
    async def prepare(step: int, version: int) -> _Job:
        async def run() -> Any:
            raise ConnectionError("engine gone")
        return _Job(step, version, run, 0.0)

    ev = Evaluator(EvalConfig(every=1), tmp_path, prepare=prepare, inline=True)
    asyncio.run(ev.after_step(0, 0))
    assert ev.failed == 1 and ev.rows[0]["eval/failed"] == 1.0 and "eval/reward" not in ev.rows[0]


def test_eval_sampling_overrides_reach_the_recipe_agent() -> None:
    """eval.sampling (temperature, max tokens, top_p) replaces the agent's own, during training and in `miles eval`."""
    from types import SimpleNamespace

    from miles_engine.config.recipe import load_recipe
    from miles_engine.evaluation import evaluator
    from miles_engine.run import evaluate as standalone
    from miles_engine.hub import default_hub

    cfg = load_recipe("tiny-terminal", ["eval.sampling.temperature=0", "eval.sampling.max_tokens=7"], hub=default_hub())
    hub = default_hub()
    during = evaluator._agent_factory(SimpleNamespace(cfg=cfg, hub=hub), "http://127.0.0.1:9")().options
    alone = standalone._agent_factory(hub, cfg, "http://127.0.0.1:9")().options
    for options in (during, alone):
        assert (options.temperature, options.max_tokens, options.max_turns) == (0.0, 7, 3)  # max_turns: the agent's
        assert options.server_url == "http://127.0.0.1:9"
    plain = SimpleNamespace(cfg=load_recipe("tiny-terminal", hub=default_hub()), hub=hub)
    untouched = evaluator._agent_factory(plain, "http://x")()
    assert (untouched.options.temperature, untouched.options.max_tokens) == (1.0, 40)


def test_shared_eval_retracts_in_flight_groups_per_rollout_mode() -> None:
    from miles_engine.evaluation.evaluator import shared_in_flight

    assert [shared_in_flight(EvalConfig(), m) for m in ("fully_async", "one_step_off", "sync")] == \
        ["retract", "finish", "finish"]
    assert shared_in_flight(EvalConfig(in_flight="finish"), "fully_async") == "finish"
    assert shared_in_flight(EvalConfig(in_flight="retract"), "sync") == "retract"


def test_the_eval_engine_is_checked_when_the_recipe_loads(tmp_path: Path) -> None:
    from miles_engine.config.recipe import load_recipe
    from miles_engine.errors import ConfigError, MilesError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("environment:\n  name: shell-drills\neval:\n  mode: dedicated\n  engine:\n    kind: server\n"
                      "    options:\n      max_batch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"r.yaml:\d+: unknown key 'eval.engine.options.max_batch_sise'"):
        load_recipe(recipe, hub=default_hub())
    sized = load_recipe(recipe, ["eval.engine.options={max_batch_size: 4}"], hub=default_hub())
    assert sized.eval.engine.options == {"max_batch_size": 4}
    with pytest.raises(MilesError, match="unknown engine 'nosuch'; available: embedded, external, server, sglang"):
        load_recipe(recipe, ["eval.engine.kind=nosuch"], hub=default_hub())
