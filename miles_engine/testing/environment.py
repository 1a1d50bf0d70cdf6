"""The environment contract suite: subclass :class:`EnvironmentContract` in your plugin's tests.

::

    import pytest
    from miles_engine.testing.environment import EnvironmentContract

    class TestMyEnvironmentContract(EnvironmentContract):
        @pytest.fixture
        def source(self):
            return MySource(...)

Every test below then runs against that source. Optional fixtures to override:

- ``sandbox_backend``: the backend episodes run on (default: the local sandbox; the episode
  tests are skipped, saying why, when it cannot meet the environment's manifest here);
- ``agent``: the scripted agent for the episode test (default: the oracle agent when the
  manifest declares reference solutions, else the no-op agent);
- ``task_id``: the task the single-task tests use (default: the first listed);
- ``unknown_task_id``: an id the source must refuse.

Class attributes bound the work: ``max_tasks_loaded`` (tasks loaded to cross-check the
manifest), ``episode_timeout_s`` (wall-clock bound of one episode).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.environments.capabilities import (
    NETWORK_ORDER,
    EnvironmentCapabilities,
    environment_capabilities,
    unmet_environment_needs,
)
from miles_engine.environments.protocol import (
    EnvironmentSource,
    RewardResult,
    Task,
    TaskLimits,
    TaskRef,
    ToolSpec,
)
from miles_engine.errors import MilesError
from miles_engine.hub import default_hub
from miles_engine.rollout.episode import EpisodeResult, run_episode
from miles_engine.sandbox.protocol import ISOLATION_ORDER

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style function calling accepts


def tool_schema_problems(tool: ToolSpec) -> list[str]:
    """Why ``tool`` is not a valid function-calling tool (empty when it is)."""
    problems: list[str] = []
    if not TOOL_NAME.match(tool.name):
        problems.append(f"tool name {tool.name!r} must match {TOOL_NAME.pattern}")
    params = tool.parameters
    if params.get("type") != "object":
        problems.append(f"tool '{tool.name}': parameters must be a JSON schema of type 'object', "
                        f"got {params.get('type')!r}")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        problems.append(f"tool '{tool.name}': 'properties' must be an object")
        props = {}
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        problems.append(f"tool '{tool.name}': 'required' {required!r} must list names from 'properties' {list(props)}")
    try:
        import jsonschema
    except ImportError:  # the structural checks above still apply
        return problems
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        problems.append(f"tool '{tool.name}': invalid JSON schema: {exc.message}")
    return problems


def manifest_gaps(caps: EnvironmentCapabilities, task: Task) -> list[str]:
    """Needs of ``task`` its environment's manifest does not declare (empty when it covers them)."""
    gaps: list[str] = []
    spec = task.sandbox_spec()
    names = [t.name for t in task.tools()]
    missing = [n for n in names if n not in caps.tools]
    if missing:
        gaps.append(f"tools {missing} not in the manifest's tools {list(caps.tools)}")
    if spec is None:
        return gaps
    if not caps.needs_sandbox:
        return [*gaps, "the task has a sandbox spec but the manifest says needs_sandbox=False"]
    if NETWORK_ORDER.index(spec.network.mode) > NETWORK_ORDER.index(caps.network):
        gaps.append(f"network '{spec.network.mode}' wider than the manifest's '{caps.network}'")
    if ISOLATION_ORDER.index(spec.min_isolation) > ISOLATION_ORDER.index(caps.min_isolation):
        gaps.append(f"isolation '{spec.min_isolation}' above the manifest's '{caps.min_isolation}'")
    for label, need, declared in (("image", bool(spec.image), caps.image),
                                  ("dockerfile_build", spec.build is not None, caps.dockerfile_build),
                                  ("absolute_paths", bool(spec.paths), caps.absolute_paths),
                                  ("run_as_user", bool(spec.user), caps.run_as_user),
                                  ("gpus", spec.resources.gpus > caps.gpus, False)):
        if need and not declared:
            gaps.append(f"the task needs {label} but the manifest does not declare it")
    return gaps


def check_episode_result(result: EpisodeResult) -> None:
    """An episode ends with a finite reward, or with no reward and an error saying why."""
    reward = result.reward
    assert isinstance(reward, RewardResult), f"episode returned {type(reward).__name__}, not RewardResult"
    if reward.reward is None:
        assert reward.error and reward.error.strip(), "a failed reward must carry an error saying why"
    else:
        assert math.isfinite(reward.reward), f"reward {reward.reward} is not finite"
    for name, value in reward.components.items():
        assert math.isfinite(value), f"reward component '{name}' = {value} is not finite"


class EnvironmentContract:
    """Contract every environment source keeps. Subclass it and provide a ``source`` fixture."""

    max_tasks_loaded: ClassVar[int] = 5
    episode_timeout_s: ClassVar[float] = 120.0

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def source(self) -> EnvironmentSource:
        raise NotImplementedError("override the 'source' fixture to return the environment source under test")

    @pytest.fixture
    def refs(self, source: EnvironmentSource) -> list[TaskRef]:
        return list(source.list_tasks())

    @pytest.fixture
    def capabilities(self, source: EnvironmentSource) -> EnvironmentCapabilities:
        return environment_capabilities(source)

    @pytest.fixture
    def task_id(self, refs: list[TaskRef]) -> str:
        if not refs:
            pytest.fail("the environment lists no tasks")
        return refs[0].id

    @pytest.fixture
    def unknown_task_id(self) -> str:
        return "miles-contract-no-such-task-7f3a"

    @pytest.fixture
    def sandbox_backend(self) -> Iterator[Any]:
        backend = default_hub().create("sandbox", "local")
        yield backend
        asyncio.run(backend.aclose())

    @pytest.fixture
    def agent(self, capabilities: EnvironmentCapabilities) -> Any:
        return OracleAgent() if capabilities.reference_solution else NopAgent()

    # ------------------------------------------------------------------ helpers
    def _usable_backend(self, capabilities: EnvironmentCapabilities, backend: Any) -> Any:
        if not capabilities.needs_sandbox:
            return backend
        needs = unmet_environment_needs(capabilities, backend.capabilities() if backend is not None else None)
        if needs:
            pytest.skip(f"sandbox backend '{getattr(backend, 'name', None)}' cannot run this environment here: "
                        f"it needs {'; '.join(needs)}")
        return backend

    def _run(self, source: EnvironmentSource, task_id: str, agent: Any, backend: Any) -> EpisodeResult:
        async def episode() -> EpisodeResult:
            return await asyncio.wait_for(run_episode(source.load_task(task_id), agent, backend),
                                          timeout=self.episode_timeout_s)

        return asyncio.run(episode())

    # ------------------------------------------------------------------ listing and loading
    def test_has_a_name(self, source: EnvironmentSource) -> None:
        assert isinstance(source.name, str) and source.name.strip(), "the source needs a non-empty 'name'"

    def test_lists_tasks_with_unique_ids(self, refs: list[TaskRef]) -> None:
        assert refs, "the environment lists no tasks"
        assert all(isinstance(r, TaskRef) for r in refs), "list_tasks must yield TaskRef objects"
        ids = [r.id for r in refs]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        assert not dupes, f"task ids listed more than once: {dupes[:10]}"
        assert all(i and i.strip() == i for i in ids), "task ids must be non-empty with no surrounding spaces"

    def test_listing_is_stable(self, source: EnvironmentSource, refs: list[TaskRef]) -> None:
        again = [r.id for r in source.list_tasks()]
        assert again == [r.id for r in refs], "two listings of the same source gave different task ids or order"

    def test_loads_a_listed_task(self, source: EnvironmentSource, task_id: str) -> None:
        task = source.load_task(task_id)
        assert isinstance(task, Task), f"load_task returned {type(task).__name__}, which is not a Task"
        assert task.id == task_id, f"load_task('{task_id}') returned a task with id '{task.id}'"
        assert isinstance(task.limits, TaskLimits)
        prompt = task.prompt()
        assert isinstance(prompt, list) and prompt, "prompt() must return a non-empty list of messages"
        for msg in prompt:
            assert msg.get("role") in ("system", "user", "assistant", "developer"), f"bad prompt message {msg!r}"
            assert isinstance(msg.get("content"), str), f"prompt message content must be a string: {msg!r}"
        again = source.load_task(task_id)
        assert again is not task, "load_task must return a fresh task object per call (attempts never share state)"
        assert again.prompt() == prompt, "loading the same task twice gave different prompts"

    def test_unknown_task_id_is_a_clear_error(self, source: EnvironmentSource, unknown_task_id: str) -> None:
        with pytest.raises(MilesError) as info:
            source.load_task(unknown_task_id)
        assert unknown_task_id in str(info.value), f"the error must name the unknown id: {info.value}"

    # ------------------------------------------------------------------ manifest and tools
    def test_capabilities_cover_the_tasks(self, source: EnvironmentSource, refs: list[TaskRef],
                                          capabilities: EnvironmentCapabilities) -> None:
        assert isinstance(capabilities, EnvironmentCapabilities)
        gaps = {}
        for ref in refs[: self.max_tasks_loaded]:
            problems = manifest_gaps(capabilities, source.load_task(ref.id))
            if problems:
                gaps[ref.id] = problems
        assert not gaps, f"the capabilities manifest does not cover these tasks: {gaps}"

    def test_tools_have_valid_schemas(self, source: EnvironmentSource, refs: list[TaskRef]) -> None:
        problems: list[str] = []
        for ref in refs[: self.max_tasks_loaded]:
            tools = source.load_task(ref.id).tools()
            names = [t.name for t in tools]
            if len(set(names)) != len(names):
                problems.append(f"task '{ref.id}' offers a tool name twice: {names}")
            for tool in tools:
                assert isinstance(tool, ToolSpec), f"task '{ref.id}': tools() must return ToolSpec objects"
                problems += [f"task '{ref.id}': {p}" for p in tool_schema_problems(tool)]
        assert not problems, "; ".join(problems)

    # ------------------------------------------------------------------ episodes
    def test_scripted_episode_ends_with_a_reward_or_an_error(
        self, source: EnvironmentSource, task_id: str, agent: Any, sandbox_backend: Any,
        capabilities: EnvironmentCapabilities,
    ) -> None:
        backend = self._usable_backend(capabilities, sandbox_backend)
        result = self._run(source, task_id, agent, backend)
        check_episode_result(result)
        if isinstance(agent, OracleAgent):
            assert result.reward.reward is not None, (
                f"the manifest declares reference solutions but the oracle episode failed: {result.reward.error}")

    def test_no_op_episode_ends_with_a_reward_or_an_error(
        self, source: EnvironmentSource, task_id: str, sandbox_backend: Any,
        capabilities: EnvironmentCapabilities,
    ) -> None:
        backend = self._usable_backend(capabilities, sandbox_backend)
        check_episode_result(self._run(source, task_id, NopAgent(), backend))
