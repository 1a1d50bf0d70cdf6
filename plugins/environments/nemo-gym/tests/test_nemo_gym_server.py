"""A resources server started from the recipe's command: lazy start, bounded wait, no orphans."""

from __future__ import annotations

import asyncio
import gc
import os
import shlex

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from miles_engine.rollout.episode import run_episode  # noqa: E402
from miles_env_nemo_gym import NemoGymOptions, NemoGymSource  # noqa: E402
from nemo_gym_testkit import SecretTimesFactorAgent, free_port, server_command  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def started_source(rows_file, command, port, **server) -> NemoGymSource:
    options = NemoGymOptions(jsonl=str(rows_file), server={"command": command, "url": f"http://127.0.0.1:{port}",
                                                           **server})
    return NemoGymSource(options)


def run(source: NemoGymSource, task_id: str = "row-000000"):
    return asyncio.run(run_episode(source.load_task(task_id), SecretTimesFactorAgent(), None))


def test_server_command_starts_at_the_first_episode_and_its_process_group_dies_on_close(rows_file):
    port = free_port()
    # through 'sh -c' so the server is a grandchild: the whole group must go, not only the shell
    source = started_source(rows_file, " ".join(map(shlex.quote, server_command(port))), port, startup_timeout_s=60)
    assert source.server.proc is None  # listing and loading start nothing
    assert len(list(source.list_tasks())) == 4
    assert run(source).reward.reward == 1.0
    assert run(source, "row-000002").reward.reward == 1.0  # the same server serves later episodes
    pgid = source.server.proc.pid
    assert group_alive(pgid)
    source.close()
    assert not group_alive(pgid)
    source.close()  # idempotent


def test_a_command_that_exits_fails_episodes_with_its_output_and_is_not_restarted(rows_file):
    port = free_port()
    source = started_source(rows_file, "echo 'config error: no such env' >&2; exit 3", port)
    first, second = run(source), run(source, "row-000001")
    assert first.reward.reward is None and second.reward.reward is None
    assert "exited with code 3 before answering at" in first.reward.error
    assert "config error: no such env" in first.reward.error
    assert second.reward.error.split(" failed: ", 1)[1] == first.reward.error.split(" failed: ", 1)[1]
    assert source.server.proc.poll() == 3
    source.close()


def test_a_server_that_never_answers_times_out_naming_the_url_and_is_killed(rows_file):
    port = free_port()
    source = started_source(rows_file, "sleep 60", port, startup_timeout_s=1.0)
    result = run(source)
    assert result.reward.reward is None
    assert f"did not answer at http://127.0.0.1:{port}/ within 1s (server.startup_timeout_s" in result.reward.error
    assert not group_alive(source.server.proc.pid)


def test_a_dropped_source_kills_its_server(rows_file):
    port = free_port()
    source = started_source(rows_file, server_command(port), port, startup_timeout_s=60)
    assert run(source).reward.reward == 1.0
    pgid = source.server.proc.pid
    del source
    gc.collect()
    assert not group_alive(pgid)


def test_miles_eval_runs_the_rows_and_stops_the_server_it_started(rows_file, tmp_path):
    import socket

    import yaml

    from miles_engine.cli.eval_cmd import _evaluate
    from miles_engine.config.recipe import load_recipe
    from miles_engine.hub import Hub

    port = free_port()
    recipe = tmp_path / "nemo.yaml"
    recipe.write_text(yaml.safe_dump({
        "environment": {"name": "nemo-gym", "options": {
            "jsonl": str(rows_file), "server": {"command": server_command(port), "url": f"http://127.0.0.1:{port}"}}},
        "agent": {"name": "nop"}, "eval": {"jobs": 2}}))
    hub = Hub()
    results = asyncio.run(_evaluate(hub, load_recipe(str(recipe), [], hub=hub)))
    assert [r.reward for r in results] == [0.0] * 4  # the no-op agent never answers (scored, not an error)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # nothing listens any more: the server's process group was killed
