"""Templates of ``miles new plugin --kind sandbox`` (starts as a wrapper over the local backend)."""

from miles_engine.scaffold import readme

FILES = {
    "README.md": readme("""
The scaffold delegates to miles' local backend so that it passes the contract suite from the
first run; replace each delegated call with your provider's API, keeping the semantics the
suite checks (exec never raises on a non-zero exit or a timeout, close is idempotent, ...).
"""),
    "PACKAGE/plugin.py": '''\
"""Registers the `$name` sandbox backend."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.sandbox.protocol import Capabilities, Sandbox, SandboxSpec


class ${cls}Options(BaseModel):
    """Options of `$name`; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")
    default_timeout_s: float = Field(60.0, gt=0, description="exec timeout when a call gives none")


class ${cls}Backend:
    name = "$name"

    def __init__(self, options: ${cls}Options) -> None:
        from miles_engine.sandbox.local.backend import LocalSandboxBackend
        from miles_engine.sandbox.local.options import LocalSandboxOptions

        self.options = options
        # TODO(provider): replace the local backend with your provider's client
        self._inner = LocalSandboxBackend(LocalSandboxOptions())

    def capabilities(self) -> Capabilities:
        return self._inner.capabilities()

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return await self._inner.create(spec)

    def __getattr__(self, attr: str) -> Any:  # sweep support and the rest of the protocol
        return getattr(self._inner, attr)

    async def aclose(self) -> None:
        await self._inner.aclose()


@hookimpl
def miles_register_sandboxes() -> list[Component]:
    return [Component("$name", ${cls}Backend, options=${cls}Options, description="$name sandboxes")]
''',
    "tests/test_contract.py": '''\
"""`$name` passes the sandbox contract suite (registered programmatically: no install needed)."""

from importlib import import_module

from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.testing.sandbox import SandboxContract


class Test${cls}Contract(SandboxContract):
    def make_backend(self):
        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(import_module("$package.plugin"), name="$package.plugin")
        return Hub(pm).create("sandbox", "$name", {})
''',
}
