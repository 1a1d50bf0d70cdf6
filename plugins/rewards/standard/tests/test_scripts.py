"""test-script on the real local sandbox: tests_dir upload, score modes, timeouts, Harbor's default paths."""

from __future__ import annotations

import asyncio

import pytest
from rewards_testkit import episode

from miles_engine.errors import ConfigError
from miles_engine.hub import Hub
from miles_engine.sandbox.protocol import SandboxSpec
from miles_rewards.scripts import ScriptOptions, ScriptVerifier


def score(options: dict, *, setup: str | None = None):
    async def go():
        backend = Hub().create("sandbox", "local", {})
        sandbox = await backend.create(SandboxSpec())
        try:
            if setup:
                assert (await sandbox.exec(setup, timeout_s=30)).ok
            return await ScriptVerifier(ScriptOptions(**options)).score(episode("done", sandbox=sandbox))
        finally:
            await sandbox.close()
            await backend.aclose()

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_tests_dir_is_uploaded_and_env_passed(tmp_path):
    (tmp_path / "test.sh").write_text('mkdir -p out && echo "$BONUS" > out/reward.txt\n')
    result = score({"command": "bash t/test.sh", "tests_dir": str(tmp_path), "tests_target": "t",
                    "verifier_dir": "out", "env": {"BONUS": "0.5"}})
    assert (result.reward, result.components, result.info["reward_file"]) == (0.5, {"reward": 0.5}, "out/reward.txt")


@pytest.mark.parametrize(("mode", "body", "reward", "error"), [
    ("reward_file", "exit 0", None, "wrote no reward file"),
    ("exit_code", "echo 1 > v/reward.txt; exit 2", 0.0, None),
    ("auto", "echo 1 > v/reward.txt; exit 2", 1.0, None),
])
def test_score_modes(mode, body, reward, error):
    result = score({"command": body, "verifier_dir": "v", "score": mode})
    assert result.reward == reward and (error is None or error in result.error)


def test_timeout_is_an_error_not_a_zero():
    result = score({"command": "sleep 30", "verifier_dir": "v", "timeout_s": 0.5})
    assert result.reward is None and "timed out after 0.5s" in result.error


def test_missing_tests_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tests_dir .*no-such.* is not a directory"):
        Hub().create("reward", "test-script", {"command": "true", "tests_dir": str(tmp_path / "no-such")})


def test_harbor_default_paths_where_the_sandbox_maps_them():
    caps = Hub().create("sandbox", "local", {}).capabilities()
    if not caps.absolute_paths:
        pytest.skip(f"the local sandbox achieves only '{caps.isolation}' isolation here: no absolute paths")
    result = score({"command": "echo '{\"reward\": 0.2, \"tests\": 4}' > /logs/verifier/reward.json"},
                   setup="mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    assert result.reward == 0.2 and result.components == {"reward": 0.2, "tests": 4.0}
