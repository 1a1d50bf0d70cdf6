"""Registration by entry point, installed-package discovery and a served app's process lifecycle."""

from __future__ import annotations

import asyncio
import shutil
import textwrap
from pathlib import Path

import pytest
from openenv_testkit import BisectingAgent

from miles_engine.hub import Hub
from miles_engine.rollout.episode import run_episode
from miles_env_openenv import OpenEnvOptions, discover_installed_environments
from miles_env_openenv.plugin import make_source

pytestmark = pytest.mark.timeout(180)
HERE = Path(__file__).resolve().parent


def test_registered_by_entry_point():
    registered = Hub().registry("environment")["openenv"]
    assert registered.distribution == "miles-env-openenv" and not registered.builtin


def _install_fake_package(root: Path) -> None:
    """An openenv-guess distribution laid out as `openenv init` makes it (module + openenv.yaml + server/app.py)."""
    dist = root / "openenv_guess-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: openenv-guess\nVersion: 0.1.0\n")
    module = root / "guess"
    (module / "server").mkdir(parents=True)
    (module / "__init__.py").write_text("")
    (module / "server" / "__init__.py").write_text("")
    shutil.copy(HERE / "toy_openenv.py", module / "server" / "app.py")
    (module / "openenv.yaml").write_text(textwrap.dedent("""\
        spec_version: 1
        name: guess_env
        description: guess the secret number
        type: space
        runtime: fastapi
        app: server.app:app
        port: 8000
        """))
    # a distribution without a manifest is not an OpenEnv environment
    other = root / "openenv_helpers-1.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: openenv-helpers\nVersion: 1.0\n")


def test_installed_package_is_discovered_served_and_stopped(tmp_path, monkeypatch):
    _install_fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = discover_installed_environments()
    assert "helpers" not in found
    env = found["guess"]
    assert (env.package, env.version, env.app) == ("openenv-guess", "0.1.0", "guess.server.app:app")
    source = make_source(OpenEnvOptions(seeds=[6], startup_timeout_s=120))  # no url/app/envs: every installed env
    try:
        assert [r.id for r in source.list_tasks()] == ["guess/seed-6"]
        assert source.capabilities().services == ("app guess.server.app:app (served on 127.0.0.1)",)
        result = asyncio.run(run_episode(source.load_task("guess/seed-6"), BisectingAgent(), None))
        assert (result.reward.reward, result.reward.error) == (1.0, None)
        server = source.targets["guess"].server
        proc = server._proc
        assert proc is not None and proc.poll() is None
    finally:
        source.close()
    assert proc.wait(timeout=10) is not None  # the served app is gone with the source
    source.close()  # idempotent


def test_a_served_app_that_cannot_start_is_one_clear_error():
    source = make_source(OpenEnvOptions(app="no_such_module_xyz:app", seeds=[0], startup_timeout_s=60))
    try:
        result = asyncio.run(run_episode(source.load_task("openenv/seed-0"), BisectingAgent(), None))
    finally:
        source.close()
    assert result.reward.reward is None
    assert "no_such_module_xyz:app" in result.reward.error and "exited with code" in result.reward.error
