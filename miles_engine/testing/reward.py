"""The reward contract suite: subclass :class:`RewardContract` in a reward plugin's tests.

    from miles_engine.testing.reward import RewardContract, SampleEpisode

    class TestMyReward(RewardContract):
        component = "my-reward"              # the registered name, checked through the hub
        plugin = "my_package.plugin"         # optional: register this module (no install needed)
        options = {"threshold": 0.5}         # options it is built with
        deterministic = True                 # the same episode always gets the same result

        def sample_episodes(self):
            return [SampleEpisode("right", [{"role": "assistant", "content": "42"}],
                                  metadata={"answer": "42"}, expected=1.0)]

Every ``test_*`` method below then runs against the component: it scores each sample and each
built-in garbage episode; results are :class:`RewardResult` objects with a finite reward or
``reward=None`` plus an error; nothing raises; expected rewards match; and a component declared
deterministic gives equal results twice. Samples that need a sandbox (``files``, ``commands`` or
``needs_sandbox``) get a fresh one from :meth:`RewardContract.make_backend` (the core ``local``
backend unless overridden), closed after scoring.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from miles_engine.environments.base import SandboxTask
from miles_engine.environments.protocol import (
    EpisodeContext,
    Message,
    RewardResult,
    TaskLimits,
)
from miles_engine.errors import ConfigError, SandboxError
from miles_engine.hub import Hub, default_hub, get_plugin_manager
from miles_engine.sandbox.protocol import ExecResult, SandboxSpec

T = TypeVar("T")
FAILED = "failed"  # SampleEpisode.expected: the component must answer reward=None with an error


@dataclass
class SampleEpisode:
    """One episode to score. ``expected`` is a reward (compared with ``tolerance``), ``FAILED``, or
    ``None`` (any valid result)."""

    name: str
    transcript: list[Message]
    metadata: dict[str, Any] = field(default_factory=dict)
    expected: float | str | None = None
    tolerance: float = 1e-6
    files: dict[str, str | bytes] = field(default_factory=dict)  # written into the sandbox first
    commands: list[str] = field(default_factory=list)  # then run there, in order
    needs_sandbox: bool = False

    @property
    def uses_sandbox(self) -> bool:
        return self.needs_sandbox or bool(self.files) or bool(self.commands)


class SampleTask(SandboxTask):
    """The task of a sample episode: its metadata, no verifier of its own."""

    def __init__(self, task_id: str, metadata: Any, *, sandbox: bool) -> None:
        super().__init__(task_id, limits=TaskLimits(verifier_timeout_s=60))
        self.metadata = metadata  # deliberately unchecked: garbage samples pass garbage here
        self._sandbox = sandbox

    def prompt(self) -> list[Message]:
        return [{"role": "user", "content": f"sample task {self.id}"}]

    def sandbox_spec(self) -> SandboxSpec | None:
        return SandboxSpec() if self._sandbox else None

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        return RewardResult.failed(f"sample task '{self.id}' has no verifier of its own")


class BrokenSandbox:
    """A sandbox whose every call fails, as a dead remote sandbox would."""

    id = "broken"
    isolation = "process"

    async def exec(self, *args: Any, **kwargs: Any) -> ExecResult:
        raise SandboxError("sandbox 'broken' is gone (contract suite: every call fails)")

    read_file = write_file = upload_dir = download_dir = exec

    async def alive(self) -> bool:
        return False

    async def close(self) -> None:
        return None


def garbage_episodes() -> list[tuple[str, Any, list[Any]]]:
    """``(name, metadata, transcript)`` triples no verifier can make sense of."""
    huge = "9" * 200_000 + " \\boxed{" * 500
    return [
        ("empty transcript", {}, []),
        ("no metadata", None, [{"role": "assistant", "content": "42"}]),
        ("metadata not a dict", ["answer", 1], [{"role": "assistant", "content": "42"}]),
        ("answer of odd type", {"answer": object(), "reference": {"x": [1]}}, [{"role": "assistant", "content": "1"}]),
        ("content None", {"answer": "1"}, [{"role": "assistant", "content": None}]),
        ("content parts", {"answer": "1"}, [{"role": "assistant", "content": [{"type": "text", "text": "1"}, 7]}]),
        ("content number", {"answer": "1"}, [{"role": "assistant", "content": 1}]),
        ("no role", {"answer": "1"}, [{"content": "1"}, {}]),
        ("not a message", {"answer": "1"}, ["assistant: 1", None, 3]),
        ("bad tool calls", {"answer": "1"}, [{"role": "assistant", "content": "", "tool_calls": "rm -rf /"},
                                             {"role": "tool", "content": b"\xff\xfe"}]),
        ("huge answer", {"answer": "1"}, [{"role": "assistant", "content": huge}]),
        ("control characters", {"answer": "\x00"}, [{"role": "assistant", "content": "\x00\x1b[2J\ud800 \\frac{1}{0}"}]),
    ]


class RewardContract:
    """Base class of a reward plugin's contract tests (see the module docstring)."""

    component: ClassVar[str | None] = None
    plugin: ClassVar[str | None] = None
    options: ClassVar[dict[str, Any]] = {}
    deterministic: ClassVar[bool | None] = None  # None: the component's own `deterministic` attribute
    timeout_s: ClassVar[float] = 120.0  # bound on scoring one episode

    # ------------------------------------------------------------------ hooks to override
    def hub(self) -> Any:
        """The hub the component is looked up in: ``plugin`` registered programmatically when set."""
        if self.plugin is None:
            return default_hub()
        from importlib import import_module

        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(import_module(self.plugin), name=self.plugin)
        return Hub(pm)

    def make_reward(self) -> Any:
        """The component under test (default: built through the hub from ``component`` and ``options``)."""
        if self.component is None:
            raise NotImplementedError(f"{type(self).__name__}: set `component` or override make_reward()")
        return self.hub().create("reward", self.component, self.options, where=f"{type(self).__name__}.options")

    def sample_episodes(self) -> list[SampleEpisode]:
        """Episodes with known verdicts; override to add the cases that exercise your component."""
        return [SampleEpisode("plain answer", [{"role": "user", "content": "What is 6*7?"},
                                               {"role": "assistant", "content": "42"}], metadata={"answer": "42"})]

    def make_backend(self) -> Any:
        """The sandbox backend of samples that need one (default: the core ``local`` backend)."""
        return default_hub().create("sandbox", "local", {})

    # ------------------------------------------------------------------ machinery
    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(self.timeout_s * 4):
                return await make()

        return asyncio.run(bounded())

    async def _score(self, reward: Any, task: Any, transcript: Any, sandbox: Any) -> RewardResult:
        ctx = EpisodeContext(task=task, sandbox=sandbox, transcript=transcript)
        async with asyncio.timeout(self.timeout_s):
            result = await reward.score(ctx)
        return result

    async def _score_sample(self, reward: Any, sample: SampleEpisode, backend: Any) -> RewardResult:
        task = SampleTask(f"sample-{sample.name}", dict(sample.metadata), sandbox=sample.uses_sandbox)
        if not sample.uses_sandbox:
            return await self._score(reward, task, list(sample.transcript), None)
        sandbox = await backend.create(SandboxSpec())
        try:
            for path, data in sample.files.items():
                await sandbox.write_file(path, data)
            for command in sample.commands:
                done = await sandbox.exec(command, timeout_s=60)
                assert done.ok, f"sample {sample.name!r}: setup command {command!r} failed: {done.stderr or done.stdout}"
            return await self._score(reward, task, list(sample.transcript), sandbox)
        finally:
            await sandbox.close()

    def score_samples(self, reward: Any | None = None) -> list[tuple[SampleEpisode, RewardResult]]:
        samples = self.sample_episodes()
        assert samples, f"{type(self).__name__}.sample_episodes() returned no samples"

        async def go() -> list[tuple[SampleEpisode, RewardResult]]:
            scorer = reward if reward is not None else self.make_reward()
            backend = self.make_backend() if any(s.uses_sandbox for s in samples) else None
            try:
                return [(s, await self._score_sample(scorer, s, backend)) for s in samples]
            finally:
                if backend is not None:
                    await backend.aclose()
                if reward is None and hasattr(scorer, "aclose"):
                    await scorer.aclose()

        return self.run(go)

    @staticmethod
    def check_result(result: Any, where: str) -> None:
        assert isinstance(result, RewardResult), f"{where}: score() returned {type(result).__name__}, not a RewardResult"
        if result.reward is None:
            assert isinstance(result.error, str) and result.error.strip(), f"{where}: reward=None needs an error"
        else:
            assert math.isfinite(result.reward), f"{where}: reward {result.reward} is not finite"
        for name, value in result.components.items():
            assert isinstance(name, str) and math.isfinite(value), f"{where}: component {name!r}={value!r}"

    # ------------------------------------------------------------------ the contract
    def test_registered_with_strict_options(self) -> None:
        if self.component is None:
            return  # built by make_reward(): nothing registered to check
        comp = self.hub().component("reward", self.component)
        assert comp.options.model_config.get("extra") == "forbid", (
            f"reward '{self.component}': its options model must set extra='forbid' so typos are errors")
        try:
            self.hub().create("reward", self.component, {**self.options, "no_such_option_xyz": 1})
        except ConfigError as exc:
            assert "no_such_option_xyz" in str(exc)
        else:
            raise AssertionError(f"reward '{self.component}' accepted an unknown option")
        reward = self.make_reward()
        assert callable(getattr(reward, "score", None)), "the component has no score(episode) method"

    def test_samples_score_as_expected(self) -> None:
        for sample, result in self.score_samples():
            where = f"sample {sample.name!r}"
            self.check_result(result, where)
            if sample.expected == FAILED:
                assert result.reward is None, f"{where}: expected a failed result, got reward {result.reward}"
            elif sample.expected is not None:
                assert result.reward is not None, f"{where}: expected {sample.expected}, got error {result.error!r}"
                assert abs(result.reward - float(sample.expected)) <= sample.tolerance, (
                    f"{where}: expected reward {sample.expected}, got {result.reward} ({result.components})")

    def test_never_raises_on_garbage(self) -> None:
        async def go() -> None:
            reward = self.make_reward()
            try:
                for name, metadata, transcript in garbage_episodes():
                    for sandbox in (None, BrokenSandbox()):
                        task = SampleTask(f"garbage-{name}", metadata, sandbox=sandbox is not None)
                        result = await self._score(reward, task, transcript, sandbox)
                        self.check_result(result, f"garbage episode {name!r} (sandbox={sandbox is not None})")
            finally:
                if hasattr(reward, "aclose"):
                    await reward.aclose()

        self.run(go)

    def test_deterministic_when_declared(self) -> None:
        reward = self.make_reward()
        declared = self.deterministic if self.deterministic is not None else getattr(reward, "deterministic", False)
        if not declared:
            return
        first = self.score_samples(reward)
        second = self.score_samples(reward)
        for (sample, a), (_, b) in zip(first, second):
            assert (a.reward, a.error, a.components) == (b.reward, b.error, b.components), (
                f"sample {sample.name!r}: declared deterministic but scored {a} then {b}")
        if hasattr(reward, "aclose"):
            self.run(reward.aclose)
