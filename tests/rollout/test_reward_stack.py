"""Reward stacks: weighted terms with components logged, failing verifiers as errors (never a crash),
the recipe's ``reward:`` section, and ``reward.on_error`` (drop / zero) applied by the buffer."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
from pydantic import BaseModel, ConfigDict

from miles_engine import hookimpl
from miles_engine.agents.builtin import OracleAgent
from miles_engine.components import Component
from miles_engine.config import load_recipe
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rewards.config import RewardConfig
from miles_engine.rewards.stack import RewardStack, StackEntry, build_reward_stack
from miles_engine.rollout.buffer import AsyncBuffer, BufferOptions
from miles_engine.rollout.episode import run_episode
from miles_engine.rollout.episodes import to_trajectory
from tests.core.fakes import FileTask, MemoryBackend
from tests.rollout.helpers import group, run, traj


class Fixed:
    def __init__(self, value=None, *, error=None, raises=None, sleep=0.0, returns=None, components=None):
        self.value, self.error, self.raises, self.sleep, self.returns = value, error, raises, sleep, returns
        self.components = components or {}
        self.calls = 0

    async def score(self, episode):
        self.calls += 1
        if self.sleep:
            await asyncio.sleep(self.sleep)
        if self.raises:
            raise self.raises
        if self.returns is not None:
            return self.returns
        return RewardResult(reward=self.value, error=self.error, components=self.components)


def ctx() -> EpisodeContext:
    return EpisodeContext(task=FileTask(spec=None), sandbox=None)


def test_weighted_sum_logs_every_term_and_its_sub_components():
    stack = RewardStack([StackEntry("answer", 1.0, Fixed(1.0, components={"answered": 1.0})),
                         StackEntry("format", 0.5, Fixed(1.0)), StackEntry("length", 0.2, Fixed(-0.5))])
    result = run(stack.score(ctx()))
    assert result.reward == pytest.approx(1.0 + 0.5 - 0.1) and result.error is None
    assert result.components == {"answer": 1.0, "answer/answered": 1.0, "format": 1.0, "length": -0.5}


@pytest.mark.parametrize(("bad", "needle"), [
    (Fixed(None, error="judge said nothing"), "judge said nothing"),
    (Fixed(raises=RuntimeError("boom")), "raised RuntimeError: boom"),
    (Fixed(returns="1.0"), "returned str, not a RewardResult"),
    (Fixed(None), "returned no reward and no error"),
])
def test_a_failing_term_fails_the_stack_naming_it_and_stops(bad, needle):
    later = Fixed(1.0)
    stack = RewardStack([StackEntry("ok", 1.0, Fixed(0.5)), StackEntry("bad", 1.0, bad), StackEntry("later", 1.0, later)])
    result = run(stack.score(ctx()))
    assert result.reward is None and result.error.startswith("reward component 'bad' failed: ") and needle in result.error
    assert result.components == {"ok": 0.5} and result.info["failed_component"] == "bad" and later.calls == 0


def test_term_timeout_and_overflowing_sum_are_errors():
    slow = RewardStack([StackEntry("slow", 1.0, Fixed(1.0, sleep=5), timeout_s=0.05)])
    assert "timed out after 0.05s" in run(slow.score(ctx())).error
    huge = RewardStack([StackEntry("a", 1e308, Fixed(10.0))])
    assert "weighted sum" in run(huge.score(ctx())).error


class ConstOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float


def _test_hub() -> Hub:
    plugin = types.ModuleType("reward_stack_test_plugin")

    @hookimpl
    def miles_register_rewards():
        return [Component("const", lambda o: Fixed(o.value), options=ConstOptions),
                Component("broken", lambda o: Fixed(raises=ValueError("verifier crashed")))]

    plugin.miles_register_rewards = miles_register_rewards
    pm = get_plugin_manager(load_entrypoints=True)  # the recipe's environment comes from an installed plugin
    pm.register(plugin, name="reward_stack_test_plugin")
    return Hub(pm)


RECIPE = """\
environment:
  name: shell-drills
reward:
  on_error: drop
  components:
    - name: task
      weight: 0.5
    - name: const
      label: bonus
      options:
        value: 2
"""


def test_recipe_reward_section_builds_the_stack(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    hub = _test_hub()
    cfg = load_recipe(path, hub=hub)
    assert cfg.reward.on_error == "drop" and [r.key for r in cfg.reward.components] == ["task", "bonus"]
    stack = build_reward_stack(hub, cfg.reward)
    assert [e.label for e in stack.entries] == ["task", "bonus"]
    assert build_reward_stack(hub, RewardConfig()) is None  # no components: the task's verifier, unchanged


@pytest.mark.parametrize(("edit", "needle"), [
    (("name: const", "name: konst"), r"r\.yaml:\d+: reward\.components\.1: .*konst"),
    (("value: 2", "valeu: 2"), r"reward\.components\.1\.options.*valeu"),
    (("label: bonus", "label: task"), "two reward components are labelled 'task'"),
    (("on_error: drop", "on_error: skip"), "drop.*zero"),
    (("weight: 0.5", "weight: .nan"), "weight must be a finite number"),
])
def test_recipe_reward_errors_name_key_and_line(tmp_path, edit, needle):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.replace(*edit))
    with pytest.raises(ConfigError, match=needle):
        load_recipe(path, hub=_test_hub())


def test_episode_marks_verifier_failures_as_reward_errors_but_not_setup_failures():
    stack = build_reward_stack(_test_hub(), RewardConfig(components=[{"name": "broken"}]))
    scored = run(run_episode(FileTask(), OracleAgent(), MemoryBackend(), reward=stack))
    assert scored.reward_error and "verifier crashed" in scored.reward.error
    good = build_reward_stack(_test_hub(), RewardConfig(components=[{"name": "task"}, {"name": "const", "options": {"value": 1}}]))
    ok = run(run_episode(FileTask(), OracleAgent(), MemoryBackend(), reward=good))
    assert (ok.reward.reward, ok.reward.components, ok.reward_error) == (2.0, {"task": 1.0, "const": 1.0}, False)
    setup = run(run_episode(FileTask(fail="setup"), OracleAgent(), MemoryBackend(), reward=stack))
    assert setup.reward.reward is None and not setup.reward_error


def test_trajectory_of_a_verifier_failure_has_status_reward_error():
    result = run(run_episode(FileTask(fail="verify"), OracleAgent(), MemoryBackend()))
    assert result.reward_error
    result.info["tito"] = {"trajectories": [{"token_ids": [1, 2], "loss_mask": [0, 1], "rollout_logprobs": [0.0, -1.0],
                                             "weight_versions": [None, 0]}]}
    t = to_trajectory(FileTask(), result)
    assert (t.status, t.reward) == ("reward_error", None) and "garbage reward" in t.error


def _groups():
    return {"partial": group([traj(), traj(reward=0.0), traj(reward=None, status="reward_error")], gid="partial"),
            "mixed": group([traj(), traj(reward=None, status="reward_error"), traj(status="timeout")], gid="mixed")}


@pytest.mark.parametrize(("on_error", "policy", "expected"), [
    ("drop", "zero_reward", {"partial": None, "mixed": None}),
    ("zero", "drop_group", {"partial": [1.0, 0.0, 0.0], "mixed": None}),
    ("zero", "drop_failed", {"partial": [1.0, 0.0, 0.0], "mixed": [1.0, 0.0]}),
    (None, "drop_failed", {"partial": [1.0, 0.0], "mixed": None}),
])
def test_buffer_applies_reward_on_error(on_error, policy, expected):
    async def go():
        buf = AsyncBuffer(BufferOptions(capacity_groups=4, partial_failure=policy, min_group_size=2),
                          on_reward_error=on_error)
        out = {}
        for gid, g in _groups().items():
            kept = await buf.put(g)
            out[gid] = [t.reward for t in g.trajectories] if kept else None
            if kept:
                assert all(t.status == "ok" for t in g.trajectories)  # what the trainer requires
                zeroed = [t for t in g.trajectories if "failure" in t.tags]
                assert all(t.reward == 0.0 for t in zeroed)
        return out, buf

    out, buf = run(go())
    assert out == expected
    if on_error == "drop":
        assert buf.dropped["reward_error"] == 2 and buf.metrics()["buffer/dropped/reward_error"] == 2.0
    assert buf.failed_trajectories["reward_error"] == 2


def test_trajectory_records_whether_a_generation_hit_max_tokens():
    from miles_engine.run.step_metrics import group_metrics

    row = {"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "rollout_logprobs": [0.0, -1.0, -1.0],
           "weight_versions": [None, 0, 0]}
    trajs = []
    for reasons in (["stop"], ["length", "stop"], []):
        result = run(run_episode(FileTask(), OracleAgent(), MemoryBackend()))
        result.info["tito"] = {"trajectories": [{**row, "turns": [{"finish_reason": r} for r in reasons]}]}
        trajs.append(to_trajectory(FileTask(), result))
    assert [t.metrics["truncated"] for t in trajs] == [0.0, 1.0, 0.0]
    metrics = group_metrics([group(trajs, gid="g")])
    assert metrics["rollout/truncated_rate"] == pytest.approx(1 / 3)
