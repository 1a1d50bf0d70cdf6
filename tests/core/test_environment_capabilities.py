"""The environment capabilities manifest and its check against a sandbox backend before start."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.environments.capabilities import (
    EnvironmentCapabilities,
    capabilities_of_tasks,
    check_environment,
    derive_capabilities,
    environment_capabilities,
    preflight,
)
from miles_engine.environments.protocol import TaskRef, ToolSpec
from miles_engine.errors import ConfigError, SandboxUnsupportedError, UnknownComponentError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.sandbox.protocol import Capabilities, NetworkPolicy, SandboxSpec
from miles_engine.testing.environment import check_episode_result, manifest_gaps, tool_schema_problems

from .fakes import FileTask, MemoryBackend

PUBLIC_SPEC = SandboxSpec(network=NetworkPolicy(mode="public"))
NO_NET = Capabilities(isolation="namespace", network_modes=frozenset({"none"}), absolute_paths=True)


class FileSource:
    def __init__(self, name: str = "files", spec: SandboxSpec | None = PUBLIC_SPEC) -> None:
        self.name, self.spec = name, spec

    def list_tasks(self) -> Iterator[TaskRef]:
        yield TaskRef(id="a")
        yield TaskRef(id="b")

    def load_task(self, task_id: str) -> FileTask:
        if task_id not in ("a", "b"):
            raise UnknownComponentError(f"unknown task '{task_id}' in environment '{self.name}'")
        return FileTask(task_id, spec=self.spec)


def test_manifest_derived_from_the_first_task() -> None:
    caps = derive_capabilities(FileSource())
    assert caps.needs_sandbox and caps.network == "public" and caps.absolute_paths
    assert caps.tools == ("bash",) and caps.multi_turn and not caps.image
    assert derive_capabilities(FileSource(spec=None)).needs_sandbox is False


def test_manifest_is_the_widest_need_over_tasks() -> None:
    wide = SandboxSpec(image="python:3.12", min_isolation="container", network=NetworkPolicy(mode="allowlist"))
    tasks = [FileTask("a", spec=SandboxSpec()), FileTask("b", spec=wide)]
    caps = capabilities_of_tasks(tasks)
    assert (caps.network, caps.image, caps.min_isolation) == ("allowlist", True, "container")


def test_manifest_rejects_contradictions() -> None:
    with pytest.raises(ValueError, match="needs_sandbox=False contradicts sandbox needs: network"):
        EnvironmentCapabilities(needs_sandbox=False, network="public")
    with pytest.raises(ValueError, match="tools lists a name twice"):
        EnvironmentCapabilities(tools=("bash", "bash"))
    with pytest.raises(ValueError):
        EnvironmentCapabilities(network="internet")


def test_network_need_on_a_no_network_backend_is_refused_naming_env_need_and_backend() -> None:
    with pytest.raises(SandboxUnsupportedError) as err:
        check_environment("web-tasks", EnvironmentCapabilities(network="public"), "sealed", NO_NET)
    msg = str(err.value)
    assert "environment 'web-tasks'" in msg and "network 'public'" in msg and "backend 'sealed'" in msg
    # every unmet need in the one error
    with pytest.raises(SandboxUnsupportedError, match="network 'public'.*container images"):
        check_environment("x", EnvironmentCapabilities(network="public", image=True), "sealed", NO_NET)
    check_environment("x", EnvironmentCapabilities(network="none"), "sealed", NO_NET)  # met: no error


def test_sandbox_free_environment_needs_no_backend() -> None:
    check_environment("http-env", EnvironmentCapabilities(needs_sandbox=False, services=("http://x",)), None, None)
    with pytest.raises(SandboxUnsupportedError, match="needs a sandbox \\(none configured\\)"):
        check_environment("files", EnvironmentCapabilities(), None, None)


def test_declared_manifest_is_used_and_validated() -> None:
    class Declares(FileSource):
        def capabilities(self):
            return {"needs_sandbox": False, "tools": ["lookup"]}

    assert environment_capabilities(Declares()).tools == ("lookup",)

    class Broken(FileSource):
        def capabilities(self):
            return {"needs_sandbox": True, "netwrok": "none"}

    with pytest.raises(ConfigError, match="environment 'files' declares invalid capabilities"):
        environment_capabilities(Broken())


def test_preflight_checks_against_the_backend() -> None:
    backend = MemoryBackend()  # supports none and public
    assert preflight(FileSource(), "memory", backend).network == "public"


class _SealedBackend(MemoryBackend):
    name = "sealed"

    def capabilities(self) -> Capabilities:
        return NO_NET


class _Plugin:
    @hookimpl
    def miles_register_environments(self):
        return [Component("web-files", lambda _opts: FileSource("web-files"))]

    @hookimpl
    def miles_register_sandboxes(self):
        return [Component("sealed", lambda _opts: _SealedBackend())]


def test_miles_eval_refuses_before_any_episode(tmp_path) -> None:
    from miles_engine.cli.eval_cmd import _evaluate
    from miles_engine.config.recipe import load_recipe

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_Plugin(), name="capability-test-plugin")
    hub = Hub(pm)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("environment: {name: web-files}\nsandbox: {backend: sealed}\nagent: {name: oracle}\n")
    cfg = load_recipe(str(recipe), [], hub=hub)
    with pytest.raises(SandboxUnsupportedError, match=r"nothing to evaluate: environment 'web-files': 2 of 2 task\(s\) "
                                                      r"excluded on sandbox backend 'sealed'") as err:
        asyncio.run(_evaluate(hub, cfg))
    assert "task 'a' needs network 'public'" in str(err.value) and "what would run it" in str(err.value)
    remedies = [line.split("what would run it")[1] for line in str(err.value).splitlines() if "what would run it" in line]
    assert len(remedies) == 2 and not any("sealed" in r for r in remedies)  # never the backend in use as the remedy


def test_contract_helpers_catch_broken_environments() -> None:
    caps = EnvironmentCapabilities(network="none", tools=("bash",), absolute_paths=True)
    gaps = manifest_gaps(caps, FileTask("a", spec=PUBLIC_SPEC))
    assert gaps == ["network 'public' wider than the manifest's 'none'"]
    assert manifest_gaps(EnvironmentCapabilities(needs_sandbox=False, tools=("bash",)), FileTask("a"))
    assert "not in the manifest's tools" in manifest_gaps(EnvironmentCapabilities(), FileTask("a"))[0]
    bad = ToolSpec(name="do it", description="", parameters={"type": "object", "properties": {"x": {"type": "nope"}},
                                                             "required": ["y"]})
    problems = " | ".join(tool_schema_problems(bad))
    assert "must match" in problems and "'required'" in problems and "invalid JSON schema" in problems
    assert tool_schema_problems(ToolSpec(name="ok", description="", parameters={"type": "object"})) == []


def test_contract_rejects_a_failed_reward_without_an_error() -> None:
    from miles_engine.agents.protocol import AgentResult
    from miles_engine.environments.protocol import RewardResult
    from miles_engine.rollout.episode import EpisodeResult

    check_episode_result(EpisodeResult("a", RewardResult(reward=0.5), AgentResult()))
    check_episode_result(EpisodeResult("a", RewardResult.failed("server down"), AgentResult()))
    with pytest.raises(AssertionError, match="must carry an error"):
        check_episode_result(EpisodeResult("a", RewardResult(reward=None), AgentResult()))
