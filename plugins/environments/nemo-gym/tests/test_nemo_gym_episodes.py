"""Episodes end to end through the episode runner against a NeMo-Gym-format resources server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from miles_engine.agents.builtin import NopAgent  # noqa: E402
from miles_engine.environments.capabilities import environment_capabilities, preflight  # noqa: E402
from miles_engine.hub import Hub  # noqa: E402
from miles_engine.rollout.episode import run_episode  # noqa: E402
from miles_engine.testing.environment import EnvironmentContract  # noqa: E402
from miles_env_nemo_gym import NemoGymSource  # noqa: E402
from nemo_gym_testkit import SecretTimesFactorAgent, free_port, make_row, write_rows  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def source_for(url: str, rows: Path, **options: object) -> NemoGymSource:
    return Hub().create("environment", "nemo-gym", {"url": url, "jsonl": str(rows), **options})


def episode(source: NemoGymSource, task_id: str, agent):
    return asyncio.run(run_episode(source.load_task(task_id), agent, None))


def test_scripted_agent_earns_the_reward_through_tools_and_verify(resources_url, rows_file):
    source = source_for(resources_url, rows_file)
    result = episode(source, "row-000001", SecretTimesFactorAgent())
    assert result.reward.reward == 1.0, result.to_dict()
    assert result.reward.components == {"correct": 1.0, "used_tools": 1.0}
    # the transcript is what went to /verify: two calls, their outputs, the answer
    assert [m["role"] for m in result.transcript] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert json.loads(result.transcript[1]["content"]) == {"secret": 4}
    assert result.transcript[-1]["content"] == "28"


def test_wrong_answer_and_no_op_score_zero(resources_url, rows_file):
    source = source_for(resources_url, rows_file)
    assert episode(source, "row-000000", SecretTimesFactorAgent(wrong=True)).reward.reward == 0.0
    nop = episode(source, "row-000000", NopAgent())
    assert nop.reward.reward == 0.0 and nop.reward.components["used_tools"] == 0.0


def test_concurrent_episodes_keep_their_own_session_cookie(resources_url, tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [make_row(i, secret=100 + i, factor=3) for i in range(6)])
    source = source_for(resources_url, rows, id_field="id")

    async def all_at_once():
        return await asyncio.gather(*(run_episode(source.load_task(f"q{i}"), SecretTimesFactorAgent(), None)
                                      for i in range(6)))

    results = asyncio.run(all_at_once())
    assert [r.reward.reward for r in results] == [1.0] * 6
    assert [r.transcript[-1]["content"] for r in results] == [str((100 + i) * 3) for i in range(6)]


def test_tool_errors_reach_the_agent_and_unknown_tools_never_reach_the_server(resources_url, rows_file):
    source = source_for(resources_url, rows_file)
    task = source.load_task("row-000000")

    class BadCalls:
        name = "bad-calls"

        async def run(self, ctx):
            bad_args = await ctx.call_tool("multiply", {"a": "x"})
            unknown = await ctx.call_tool("delete_everything", {})
            ctx.info["seen"] = (bad_args.is_error, bad_args.content, unknown.is_error, unknown.content)
            from miles_engine.agents.protocol import AgentResult
            return AgentResult(turns=2)

    result = asyncio.run(run_episode(task, BadCalls(), None))
    bad_is_error, bad_text, unknown_is_error, unknown_text = result.info["seen"]
    assert bad_is_error and "a" in bad_text  # the server's 422 validation detail, passed on as is
    assert unknown_is_error and "unknown tool 'delete_everything'" in unknown_text and "get_secret" in unknown_text
    assert result.reward.reward == 0.0


@pytest.mark.parametrize("mode, expected", [
    ("text", "returned invalid JSON: 'reward: lots'"),
    ("no_reward", "returned no 'reward' field (fields: score)"),
    ("string_reward", "non-numeric or non-finite reward 'high'"),
    ("http500", "answered HTTP 500"),
    ("masked", "masked the sample (not a valid measurement): judge timed out"),
])
def test_garbage_from_verify_is_a_failed_reward_naming_the_url(resources_url, tmp_path, mode, expected):
    rows = write_rows(tmp_path / "rows.jsonl", [make_row(0, secret=2, verify_mode=mode)])
    result = episode(source_for(resources_url, rows), "row-000000", SecretTimesFactorAgent())
    assert result.reward.reward is None
    assert f"NeMo Gym verify at {resources_url}/verify" in result.reward.error and expected in result.reward.error


def test_unreachable_server_fails_the_episode_with_the_url_and_the_run_continues(resources_url, rows_file):
    dead = f"http://127.0.0.1:{free_port()}"
    down, up = source_for(dead, rows_file), source_for(resources_url, rows_file)

    async def run_both():
        return await asyncio.gather(run_episode(down.load_task("row-000000"), SecretTimesFactorAgent(), None),
                                    run_episode(up.load_task("row-000000"), SecretTimesFactorAgent(), None))

    failed, ok = asyncio.run(run_both())
    assert failed.reward.reward is None
    assert f"NeMo Gym resources server at {dead}/seed_session is unreachable" in failed.reward.error
    assert failed.agent.stop_reason == "not_started"
    assert ok.reward.reward == 1.0


def test_manifest_needs_no_sandbox_and_lists_the_row_tools(resources_url, rows_file):
    source = source_for(resources_url, rows_file)
    caps = environment_capabilities(source)
    assert not caps.needs_sandbox and caps.tools == ("get_secret", "multiply") and caps.services == (resources_url,)
    preflight(source, None, None)  # no sandbox backend is fine


class TestNemoGymContract(EnvironmentContract):
    @pytest.fixture
    def source(self, resources_url, rows_file):
        return source_for(resources_url, rows_file)

    @pytest.fixture
    def agent(self):
        return SecretTimesFactorAgent()

    @pytest.fixture
    def sandbox_backend(self):
        return None
