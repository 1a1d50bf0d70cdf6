"""Registers the ``terminal-bench`` environment: terminal-bench 1.x task directories on disk."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_engine import hookimpl
from miles_engine.components import Component, Section

from miles_env_terminal_bench.source import TerminalBenchSource


class TerminalBenchOptions(Section):
    """Options of the ``terminal-bench`` environment."""

    path: str = Field(description="a directory of terminal-bench task directories, or one task directory")
    include: list[str] = Field(default_factory=list, description="glob patterns on task ids to keep")
    exclude: list[str] = Field(default_factory=list, description="glob patterns on task ids to drop")
    ignore_dockerfile: bool = Field(
        False,
        description="run on the backend's default userland instead of building the task's Dockerfile; "
        "you accept fidelity loss",
    )
    network: Literal["none", "public"] = Field("none", description="network given to every task")


def make_source(options: TerminalBenchOptions) -> TerminalBenchSource:
    return TerminalBenchSource(options.path, include=options.include, exclude=options.exclude,
                               ignore_dockerfile=options.ignore_dockerfile, network=options.network)


@hookimpl
def miles_register_environments() -> list[Component]:
    return [
        Component(
            "terminal-bench",
            make_source,
            options=TerminalBenchOptions,
            description="terminal-bench 1.x task directories (task.yaml, run-tests.sh, tests/)",
        )
    ]
