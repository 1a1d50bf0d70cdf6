"""Registers the ``docker`` sandbox backend."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component

from miles_sandbox_docker.options import DockerSandboxOptions


def make_docker_backend(options: DockerSandboxOptions):
    from miles_sandbox_docker.backend import DockerSandboxBackend

    return DockerSandboxBackend(options)


@hookimpl
def miles_register_sandboxes() -> list[Component]:
    return [
        Component(
            "docker",
            make_docker_backend,
            options=DockerSandboxOptions,
            description="a container per sandbox on a Docker engine (docker CLI): images, Dockerfile builds, "
            "network none/public, resources, run labels + sweep",
        )
    ]
