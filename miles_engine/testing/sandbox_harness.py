"""The plumbing under the sandbox contract suite (:mod:`miles_engine.testing.sandbox`).

The hooks a backend's test class overrides, its tuning knobs, and the class-scoped fixtures:
one event loop and one backend per test class, every case bounded by ``case_timeout_s``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ClassVar, TypeVar

import pytest

from miles_engine.sandbox.protocol import (
    NetworkPolicy,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
)

T = TypeVar("T")


class ContractHarness:
    """Hooks, class-level knobs and fixtures of :class:`~miles_engine.testing.sandbox.SandboxContract`."""

    spec_overrides: ClassVar[dict[str, Any]] = {}
    case_timeout_s: ClassVar[float] = 60.0
    exercise_stdin: ClassVar[bool] = True
    exercise_dirs: ClassVar[bool] = True
    exercise_process_tree_kill: ClassVar[bool] = True
    exercise_network: ClassVar[bool] = True
    exercise_sweep: ClassVar[bool] = True

    # ------------------------------------------------------------------ hooks
    def make_backend(self, *args: Any) -> SandboxBackend | Awaitable[SandboxBackend]:
        """Build the backend under test (called once per class, inside its event loop; may be
        async). Declared as ``make_backend(self, request)`` it gets the pytest request, to
        reach other fixtures with ``request.getfixturevalue(name)``."""
        raise NotImplementedError("subclass SandboxContract and implement make_backend()")

    async def labels_of(self, backend: SandboxBackend, sandbox: Sandbox) -> dict[str, str] | None:
        """The labels the provider stores for ``sandbox``; ``None`` skips the label check."""
        return None

    def base_spec(self, backend: SandboxBackend, **updates: Any) -> SandboxSpec:
        """The simplest spec the backend supports, plus ``spec_overrides`` and ``updates``."""
        caps = backend.capabilities()
        fields: dict[str, Any] = {
            "network": NetworkPolicy(mode="none" if "none" in caps.network_modes else next(iter(sorted(caps.network_modes)))),
            "min_isolation": "process",
        }
        if not caps.absolute_paths:
            fields["paths"] = ()
        return SandboxSpec(**{**fields, **self.spec_overrides, **updates})

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def contract_loop(cls) -> Iterator[asyncio.AbstractEventLoop]:
        loop = asyncio.new_event_loop()
        yield loop
        loop.close()

    @pytest.fixture(scope="class")
    @classmethod
    def sandbox_backend(
        cls, contract_loop: asyncio.AbstractEventLoop, request: pytest.FixtureRequest
    ) -> Iterator[SandboxBackend]:
        instance = cls()
        wants_request = len(inspect.signature(instance.make_backend).parameters) > 0

        async def build() -> SandboxBackend:
            made = instance.make_backend(request) if wants_request else instance.make_backend()
            return await made if asyncio.iscoroutine(made) else made  # type: ignore[return-value]

        backend = contract_loop.run_until_complete(build())
        yield backend
        contract_loop.run_until_complete(asyncio.wait_for(backend.aclose(), cls.case_timeout_s))

    @pytest.fixture
    def run(self, contract_loop: asyncio.AbstractEventLoop) -> Callable[[Awaitable[T]], T]:
        def run(coro: Awaitable[T]) -> T:
            return contract_loop.run_until_complete(asyncio.wait_for(coro, self.case_timeout_s))

        return run

    async def _with_sandbox(self, backend: SandboxBackend, body: Callable[[Sandbox], Awaitable[T]], **spec: Any) -> T:
        async with await backend.create(self.base_spec(backend, **spec)) as sb:
            return await body(sb)
