"""The E2B sandbox backend: Firecracker microVMs from E2B templates."""

from __future__ import annotations

import ipaddress
import types
from typing import Any

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import (
    RUN_LABEL,
    SANDBOX_LABEL,
    Capabilities,
    SandboxSpec,
    check_supported,
)
from miles_engine.sandbox.remote import (
    TransientError,
    redact,
    require_env,
    retry_idempotent,
    run_id_for,
    sandbox_labels,
)
from miles_engine.sandbox.remote_sandbox import (
    RemoteSandbox,
    close_all,
    new_sandbox_id,
    start_remote_sandbox,
)
from miles_sandbox_e2b.options import E2BSandboxOptions
from miles_sandbox_e2b.templates import (
    ensure_template,
    needs_template,
    template_request,
)
from miles_sandbox_e2b.transport import E2BTransport, classify


def load_sdk() -> types.SimpleNamespace:
    """The parts of the ``e2b`` package the backend calls (tests pass a fake with this shape)."""
    import e2b

    return types.SimpleNamespace(AsyncSandbox=e2b.AsyncSandbox, AsyncTemplate=e2b.AsyncTemplate, SandboxQuery=e2b.SandboxQuery)


def network_opts(spec: SandboxSpec) -> dict[str, Any]:
    """``AsyncSandbox.create`` keyword arguments for the spec's network policy."""
    mode = spec.network.mode
    if mode == "none":
        return {"allow_internet_access": False}
    if mode == "allowlist":
        return {"network": {"allow_out": list(spec.network.allowed_hosts), "deny_out": ["0.0.0.0/0"]}}
    return {"allow_internet_access": True}


class E2BSandboxBackend:
    name = "e2b"

    def __init__(self, options: E2BSandboxOptions | None = None, *, sdk: Any = None, api_key: str | None = None) -> None:
        """``api_key`` defaults to ``$E2B_API_KEY`` (missing: one error naming it)."""
        self.options = options or E2BSandboxOptions()
        self.api_key = api_key or require_env("e2b", "E2B_API_KEY")
        self.sdk = sdk or load_sdk()
        self._live: set[RemoteSandbox] = set()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            isolation="microvm",
            network_modes=frozenset({"none", "public", "allowlist"}),
            images=True,
            dockerfile_build=True,
            absolute_paths=True,
            run_as_user=False,
            gpus=False,
        )

    async def create(self, spec: SandboxSpec) -> RemoteSandbox:
        check_supported(spec, self.capabilities(), backend=self.name)
        _check_hosts(spec)
        o = self.options
        sandbox_id = new_sandbox_id(self.name)
        labels = sandbox_labels(spec, sandbox_id=sandbox_id, run_id=run_id_for(spec, o.run_id))
        template = o.template
        if needs_template(spec):
            name, parts = template_request(spec, o.template_prefix)
            template = await self._retry(lambda: ensure_template(self.sdk, name, parts, api_key=self.api_key),
                                         f"building template {name}")
        lifetime = int(spec.ttl_s) if spec.ttl_s else o.lifetime_s

        async def make() -> Any:
            try:
                return await self.sdk.AsyncSandbox.create(
                    template=template,
                    timeout=max(1, lifetime),
                    metadata=labels,
                    api_key=self.api_key,
                    request_timeout=o.request_timeout_s,
                    **network_opts(spec),
                )
            except Exception as exc:
                err = classify(exc, what="creating a sandbox", api_key=self.api_key)
                if type(err) is TransientError:  # the answer may be lost while the sandbox exists
                    await self._kill_labelled({SANDBOX_LABEL: sandbox_id})
                raise err from exc

        sandbox = await self._retry(make, "creating a sandbox")
        transport = E2BTransport(sandbox, api_key=self.api_key, request_timeout_s=o.request_timeout_s)
        return await start_remote_sandbox(
            transport, spec, sandbox_id=sandbox_id, provider=self.name, isolation="microvm", options=o, live=self._live
        )

    async def sweep(self, run_id: str) -> list[str]:
        """Kill every sandbox labelled with ``run_id``; return their miles ids."""
        return await self._kill_labelled({RUN_LABEL: run_id})

    async def _kill_labelled(self, metadata: dict[str, str]) -> list[str]:
        query = self.sdk.SandboxQuery(metadata=metadata)
        what = ", ".join(f"{k}={v}" for k, v in metadata.items())

        async def listing() -> list[Any]:
            paginator = self.sdk.AsyncSandbox.list(query=query, api_key=self.api_key)
            found: list[Any] = []
            while paginator.has_next:
                found.extend(await paginator.next_items())
            return found

        removed: list[str] = []
        for info in await self._retry(listing, f"listing sandboxes labelled {what}"):
            await self._retry(lambda i=info: self.sdk.AsyncSandbox.kill(i.sandbox_id, api_key=self.api_key),
                              f"killing sandbox {info.sandbox_id}")
            removed.append(info.metadata.get(SANDBOX_LABEL, info.sandbox_id))
        return removed

    async def aclose(self) -> None:
        await close_all(self._live)

    async def _retry(self, call, what: str):
        async def attempt():
            try:
                return await call()
            except (SandboxError, FileNotFoundError):
                raise
            except Exception as exc:
                raise classify(exc, what=what, api_key=self.api_key) from exc

        try:
            return await retry_idempotent(attempt, what=f"e2b: {what}", policy=self.options.retry)
        except Exception as exc:  # messages may quote request details: never the key
            exc.args = tuple(redact(str(a), [self.api_key]) for a in exc.args)
            raise


def _check_hosts(spec: SandboxSpec) -> None:
    from miles_engine.errors import SandboxUnsupportedError

    if spec.network.mode == "allowlist" and not spec.network.allowed_hosts:
        raise SandboxUnsupportedError("e2b: network 'allowlist' needs at least one entry in allowed_hosts")
    for host in spec.network.allowed_hosts:
        try:
            ipaddress.ip_network(host, strict=False)
        except ValueError:
            if not host or "/" in host or " " in host:
                raise SandboxUnsupportedError(
                    f"e2b: allowed host {host!r} is neither an IP/CIDR nor a host name"
                ) from None
