"""What a capability refusal offers as the remedy: backends that provide the need, never the one in use."""

from __future__ import annotations

import pytest

from miles_engine.errors import SandboxUnsupportedError
from miles_engine.sandbox.protocol import (
    Capabilities,
    NetworkPolicy,
    Resources,
    SandboxSpec,
    UnmetNeed,
    check_supported,
    remedy,
)

BACKENDS = ("local", "docker", "daytona", "e2b", "modal", "my-plugin")
NEEDS = [UnmetNeed("gpus", "1 GPU(s)"), UnmetNeed("image", "image"), UnmetNeed("build", "build"),
         UnmetNeed("paths", "paths"), UnmetNeed("services", "sidecars"), UnmetNeed("user", "user"),
         UnmetNeed("isolation", "container", "container"), UnmetNeed("network", "allowlist", "allowlist"),
         UnmetNeed("network", "none", "none"), UnmetNeed("memory", "memory")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("need", NEEDS, ids=lambda n: f"{n.field}-{n.detail}")
def test_the_backend_in_use_is_never_offered(backend, need):
    offered = remedy([need], backend).split(" or, on this backend,")[0]
    assert f"{backend} " not in offered + " " and f"{backend}," not in offered


def test_a_setting_of_the_backend_in_use_is_said_as_such():
    text = remedy([UnmetNeed("gpus", "1 GPU(s)")], "docker")
    assert text == ("a sandbox backend that provides it: modal (sandbox option gpu=<type>) or, on this backend, "
                    "sandbox option gpus=true, on a host with NVIDIA GPUs")


def test_several_needs_offer_only_backends_that_meet_them_all():
    text = remedy([UnmetNeed("gpus", "1 GPU(s)"), UnmetNeed("services", "sidecars")], "local")
    assert text == "a sandbox backend that provides it: docker (sandbox option gpus=true, on a host with NVIDIA GPUs)"
    assert remedy([UnmetNeed("services", "sidecars")], "docker") == "no known sandbox backend provides it"


def test_check_supported_names_the_task_the_needs_and_the_remedy():
    spec = SandboxSpec(image="ubuntu:24.04", resources=Resources(gpus=1), network=NetworkPolicy(mode="none"))
    caps = Capabilities(isolation="container", network_modes=frozenset({"none", "public"}), images=True,
                        absolute_paths=True)
    with pytest.raises(SandboxUnsupportedError) as err:
        check_supported(spec, caps, backend="docker", task="train-a-model")
    msg = str(err.value)
    assert msg.startswith("sandbox backend 'docker' cannot run task 'train-a-model': it needs 1 GPU(s). ")
    assert "What would run it: a sandbox backend that provides it: modal" in msg and "e.g. docker" not in msg
