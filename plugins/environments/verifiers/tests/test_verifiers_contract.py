"""The environment contract suite against verifiers tasksets defined in the tests."""

from __future__ import annotations

import pytest

from miles_engine.testing.environment import EnvironmentContract
from miles_env_verifiers import VerifiersOptions
from miles_env_verifiers.plugin import make_source

pytestmark = pytest.mark.timeout(180)


class TestSingleTurnContract(EnvironmentContract):
    @pytest.fixture
    def source(self):
        return make_source(VerifiersOptions(taskset="toy_vf_arith"))


class TestToolsetContract(EnvironmentContract):
    @pytest.fixture
    def source(self):
        return make_source(VerifiersOptions(taskset="toy_vf_tools"))
