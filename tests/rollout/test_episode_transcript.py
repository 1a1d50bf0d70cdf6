"""An episode keeps what the run's trajectory record shows: the conversation and every command the
sandbox ran (exit code, duration, start, phase, truncation), carried onto the Trajectory."""

from __future__ import annotations

import asyncio

import pytest

from miles_engine.agents.builtin import OracleAgent
from miles_engine.hub import Hub
from miles_engine.rollout.episode import run_episode
from miles_engine.rollout.episodes import to_trajectory
from miles_engine.sandbox.protocol import unmet_needs

drills = pytest.importorskip("miles_env_terminal_tasks.drills")


def _backend():
    backend = Hub().create("sandbox", "local")
    needs = unmet_needs(drills.ShellDrillsSource().load_task("echo-000000").sandbox_spec(), backend.capabilities())
    if needs:
        pytest.skip(f"local sandbox cannot run these tasks here: it needs {'; '.join(needs)}")
    return backend


def test_a_tool_using_episode_carries_its_conversation_and_commands() -> None:
    source, backend = drills.ShellDrillsSource(drills.DrillOptions(seed=3)), _backend()
    task = source.make_task("write-file", 0)

    async def episode():
        try:
            return await run_episode(task, OracleAgent(), backend)
        finally:
            await backend.aclose()

    result = asyncio.run(episode())
    assert result.reward.reward == 1.0
    transcript = to_trajectory(task, result).transcript  # the oracle samples no tokens: an empty row, same transcript
    messages = transcript["messages"]
    roles = [m["role"] for m in messages]
    assert "tool" in roles and any(m.get("tool_calls") for m in messages if m["role"] == "assistant")
    commands = transcript["commands"]
    by_phase = {c["phase"]: c for c in commands}
    assert {"agent", "verify"} <= set(by_phase)
    assert by_phase["agent"]["command"] == task.instance.reference_command and by_phase["agent"]["exit_code"] == 0
    assert by_phase["verify"]["command"].startswith("test -f") and by_phase["verify"]["exit_code"] == 0
    assert all(c["duration_s"] >= 0 and c["started_s"] >= 0 and c["truncated"] is False for c in commands)
    assert [c["started_s"] for c in commands] == sorted(c["started_s"] for c in commands)
