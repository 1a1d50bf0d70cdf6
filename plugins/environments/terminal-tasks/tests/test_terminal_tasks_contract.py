"""The packaged terminal tasks and the shell drills keep the environment contract."""

from __future__ import annotations

import pytest

from miles_engine.testing.environment import EnvironmentContract
from miles_env_terminal_tasks import packaged_source
from miles_env_terminal_tasks.drills import DrillOptions, ShellDrillsSource


class TestTerminalTasksContract(EnvironmentContract):
    @pytest.fixture
    def source(self):
        return packaged_source()


class TestShellDrillsContract(EnvironmentContract):
    @pytest.fixture
    def source(self):
        return ShellDrillsSource(DrillOptions(num_tasks=20))

    @pytest.fixture
    def unknown_task_id(self) -> str:
        return "no-such-kind-000001"
