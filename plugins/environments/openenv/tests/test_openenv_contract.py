"""The environment contract suite, against a real OpenEnv server (OpenEnv's create_app on 127.0.0.1)."""

from __future__ import annotations

import pytest
from openenv_testkit import serve

from miles_engine.testing.environment import EnvironmentContract
from miles_env_openenv import OpenEnvOptions
from miles_env_openenv.plugin import make_source

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server_url():
    toy = pytest.importorskip("toy_openenv")
    with serve(toy.make_app(max_concurrent_envs=8)) as url:
        yield url


class TestOpenEnvContract(EnvironmentContract):
    @pytest.fixture
    def source(self, server_url):
        return make_source(OpenEnvOptions(url=server_url, seeds=[0, 1, 2]))
