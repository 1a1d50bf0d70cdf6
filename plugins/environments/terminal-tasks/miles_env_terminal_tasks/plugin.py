"""Registers the ``terminal-tasks`` and ``shell-drills`` environments."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component

from miles_env_terminal_tasks.drills import DrillOptions, ShellDrillsSource
from miles_env_terminal_tasks.packaged import TerminalTasksOptions, make_terminal_tasks


def make_shell_drills(options: DrillOptions) -> ShellDrillsSource:
    return ShellDrillsSource(options)


@hookimpl
def miles_register_environments() -> list[Component]:
    return [
        Component(
            "terminal-tasks",
            make_terminal_tasks,
            options=TerminalTasksOptions,
            description="packaged Harbor-format terminal tasks that run on the local sandbox without Docker",
        ),
        Component(
            "shell-drills",
            make_shell_drills,
            options=DrillOptions,
            description="generated shell drills (echo, calc, write-file, count, grep) with noisy demonstrations",
        ),
    ]
