"""The Daytona sandbox backend: cloud containers from a snapshot, a registry image or a Dockerfile."""

from __future__ import annotations

import ipaddress
import math
import os
import types
from typing import Any

from miles_engine.errors import SandboxError, SandboxUnsupportedError
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
from miles_sandbox_daytona.options import DaytonaSandboxOptions
from miles_sandbox_daytona.transport import DaytonaTransport, classify

_GIB = 1024  # Daytona sizes memory and disk in GiB; specs in MiB


def load_sdk() -> types.SimpleNamespace:
    """The parts of the ``daytona`` package the backend calls (tests pass a fake with this shape)."""
    import daytona

    return types.SimpleNamespace(
        AsyncDaytona=daytona.AsyncDaytona,
        DaytonaConfig=daytona.DaytonaConfig,
        CreateSandboxFromImageParams=daytona.CreateSandboxFromImageParams,
        CreateSandboxFromSnapshotParams=daytona.CreateSandboxFromSnapshotParams,
        Resources=daytona.Resources,
        Image=daytona.Image,
        ListSandboxesQuery=daytona.ListSandboxesQuery,
    )


def network_params(spec: SandboxSpec) -> dict[str, Any]:
    """Create parameters for the spec's network policy: CIDRs go to ``network_allow_list``,
    host names to ``domain_allow_list`` (both comma-separated)."""
    mode = spec.network.mode
    if mode == "none":
        return {"network_block_all": True}
    if mode == "public":
        return {"network_block_all": False}
    cidrs, domains = [], []
    for host in spec.network.allowed_hosts:
        try:
            cidrs.append(str(ipaddress.ip_network(host, strict=False)))
        except ValueError:
            domains.append(host)
    if not cidrs and not domains:
        raise SandboxUnsupportedError("daytona: network 'allowlist' needs at least one entry in allowed_hosts")
    return {
        "network_block_all": False,
        "network_allow_list": ",".join(cidrs) or None,
        "domain_allow_list": ",".join(domains) or None,
    }


class DaytonaSandboxBackend:
    name = "daytona"

    def __init__(self, options: DaytonaSandboxOptions | None = None, *, sdk: Any = None, api_key: str | None = None) -> None:
        """``api_key`` defaults to ``$DAYTONA_API_KEY`` (missing: one error naming it)."""
        self.options = options or DaytonaSandboxOptions()
        self.api_key = api_key or require_env("daytona", "DAYTONA_API_KEY")
        self.sdk = sdk or load_sdk()
        self._client: Any = None  # one AsyncDaytona per backend, made inside the event loop
        self._live: set[RemoteSandbox] = set()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            isolation="container",
            network_modes=frozenset({"none", "public", "allowlist"}),
            images=True,
            dockerfile_build=True,
            absolute_paths=True,
            run_as_user=False,
            gpus=False,
        )

    def client(self) -> Any:
        if self._client is None:
            self._client = self.sdk.AsyncDaytona(
                self.sdk.DaytonaConfig(
                    api_key=self.api_key,
                    api_url=os.environ.get("DAYTONA_API_URL") or None,
                    target=os.environ.get("DAYTONA_TARGET") or None,
                )
            )
        return self._client

    def create_params(self, spec: SandboxSpec, labels: dict[str, str]) -> Any:
        o, sdk = self.options, self.sdk
        common: dict[str, Any] = {
            "labels": labels,
            "auto_stop_interval": o.auto_stop_minutes,
            "auto_delete_interval": 0,  # deleted as soon as it stops: nothing lingers
            **network_params(spec),
        }
        if spec.ttl_s:
            common["ttl_minutes"] = max(1, math.ceil(spec.ttl_s / 60))
        r = spec.resources
        if spec.build is None and not spec.image and not (r.cpus or r.memory_mb or r.disk_mb):
            return sdk.CreateSandboxFromSnapshotParams(snapshot=o.snapshot, **common)
        if spec.build is not None:
            dockerfile = spec.build.context_dir / spec.build.dockerfile
            if not dockerfile.is_file():
                raise SandboxError(f"daytona: Dockerfile not found: {dockerfile}")
            image: Any = sdk.Image.from_dockerfile(dockerfile)
        else:
            image = spec.image or o.default_image
        resources = sdk.Resources(
            cpu=math.ceil(r.cpus) if r.cpus else None,
            memory=math.ceil(r.memory_mb / _GIB) if r.memory_mb else None,
            disk=math.ceil(r.disk_mb / _GIB) if r.disk_mb else None,
        )
        return sdk.CreateSandboxFromImageParams(image=image, resources=resources, **common)

    async def create(self, spec: SandboxSpec) -> RemoteSandbox:
        check_supported(spec, self.capabilities(), backend=self.name)
        sandbox_id = new_sandbox_id(self.name)
        labels = sandbox_labels(spec, sandbox_id=sandbox_id, run_id=run_id_for(spec, self.options.run_id))
        params = self.create_params(spec, labels)

        async def make() -> Any:
            try:
                return await self.client().create(params, timeout=self.options.create_timeout_s)
            except Exception as exc:
                err = classify(exc, what="creating a sandbox", api_key=self.api_key)
                if type(err) is TransientError:  # the answer may be lost while the sandbox exists
                    await self._delete_labelled({SANDBOX_LABEL: sandbox_id})
                raise err from exc

        sandbox = await self._retry(make, "creating a sandbox")
        return await start_remote_sandbox(
            DaytonaTransport(sandbox, api_key=self.api_key), spec, sandbox_id=sandbox_id, provider=self.name,
            isolation="container", options=self.options, live=self._live,
        )

    async def sweep(self, run_id: str) -> list[str]:
        """Delete every sandbox labelled with ``run_id``; return their miles ids."""
        return await self._delete_labelled({RUN_LABEL: run_id})

    async def _delete_labelled(self, labels: dict[str, str]) -> list[str]:
        what = ", ".join(f"{k}={v}" for k, v in labels.items())

        async def listing() -> list[Any]:
            found = [sb async for sb in self.client().list(self.sdk.ListSandboxesQuery(labels=labels))]
            return [sb for sb in found if str(getattr(sb.state, "value", sb.state)) not in ("destroyed", "destroying")]

        removed: list[str] = []
        for sb in await self._retry(listing, f"listing sandboxes labelled {what}"):
            transport = DaytonaTransport(sb, api_key=self.api_key)
            await self._retry(transport.destroy, f"deleting sandbox {sb.id}")
            removed.append((sb.labels or {}).get(SANDBOX_LABEL, sb.id))
        return removed

    async def aclose(self) -> None:
        await close_all(self._live)
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def _retry(self, call, what: str):
        async def attempt():
            try:
                return await call()
            except (SandboxError, FileNotFoundError):
                raise
            except Exception as exc:
                raise classify(exc, what=what, api_key=self.api_key) from exc

        try:
            return await retry_idempotent(attempt, what=f"daytona: {what}", policy=self.options.retry)
        except Exception as exc:
            exc.args = tuple(redact(str(a), [self.api_key]) for a in exc.args)
            raise
