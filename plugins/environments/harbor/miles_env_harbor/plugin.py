"""Registers the ``harbor`` environment: Harbor task directories on disk."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_engine import hookimpl
from miles_engine.components import Component, Section

from miles_env_harbor.source import HarborSource


class HarborOptions(Section):
    """Options of the ``harbor`` environment."""

    path: str = Field(description="a directory of Harbor task directories, or one task directory")
    include: list[str] = Field(default_factory=list, description="glob patterns on task ids to keep")
    exclude: list[str] = Field(default_factory=list, description="glob patterns on task ids to drop")
    ignore_dockerfile: bool = Field(
        False,
        description="run on the backend's default userland, ignoring docker_image and Dockerfiles "
        "(you accept fidelity loss)",
    )
    default_network: Literal["none", "public"] = Field(
        "none", description="network for tasks whose task.toml declares none"
    )


def make_source(options: HarborOptions) -> HarborSource:
    return HarborSource(
        options.path,
        name="harbor",
        include=options.include,
        exclude=options.exclude,
        ignore_dockerfile=options.ignore_dockerfile,
        default_network=options.default_network,
    )


@hookimpl
def miles_register_environments() -> list[Component]:
    return [
        Component(
            "harbor",
            make_source,
            options=HarborOptions,
            description="Harbor task directories (task.toml, instruction.md, tests/test.sh)",
        )
    ]
