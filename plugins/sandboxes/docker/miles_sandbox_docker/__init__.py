"""Docker sandboxes for miles: one container per sandbox, driven through the docker CLI."""

from miles_sandbox_docker.options import DockerSandboxOptions

__all__ = ["DockerSandboxOptions"]
