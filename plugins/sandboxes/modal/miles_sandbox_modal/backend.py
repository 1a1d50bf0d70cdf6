"""The Modal sandbox backend: gVisor containers from a registry image or a Dockerfile."""

from __future__ import annotations

import ipaddress
import math
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
from miles_sandbox_modal.options import ModalSandboxOptions
from miles_sandbox_modal.transport import ModalTransport, classify

KEEP_ALIVE = ("sleep", "infinity")  # the sandbox's own command: commands arrive through exec


def load_sdk() -> types.SimpleNamespace:
    """The parts of the ``modal`` package the backend calls (tests pass a fake with this shape)."""
    import modal

    return types.SimpleNamespace(App=modal.App, Image=modal.Image, Sandbox=modal.Sandbox)


def network_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    mode = spec.network.mode
    if mode == "none":
        return {"block_network": True}
    if mode == "public":
        return {"block_network": False}
    cidrs, domains = [], []
    for host in spec.network.allowed_hosts:
        try:
            cidrs.append(str(ipaddress.ip_network(host, strict=False)))
        except ValueError:
            domains.append(host)
    if not cidrs and not domains:
        raise SandboxUnsupportedError("modal: network 'allowlist' needs at least one entry in allowed_hosts")
    return {
        "block_network": False,
        "outbound_cidr_allowlist": cidrs or None,
        "outbound_domain_allowlist": domains or None,
    }


class ModalSandboxBackend:
    name = "modal"

    def __init__(self, options: ModalSandboxOptions | None = None, *, sdk: Any = None) -> None:
        self.options = options or ModalSandboxOptions()
        # The modal client reads these itself; checked here for one clear line when missing.
        self._secrets = [require_env("modal", "MODAL_TOKEN_ID"), require_env("modal", "MODAL_TOKEN_SECRET")]
        self.sdk = sdk or load_sdk()
        self._app: Any = None
        self._live: set[RemoteSandbox] = set()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            isolation="container",
            network_modes=frozenset({"none", "public", "allowlist"}),
            images=True,
            dockerfile_build=True,
            absolute_paths=True,
            run_as_user=False,
            gpus=self.options.gpu is not None,
        )

    async def app(self) -> Any:
        if self._app is None:
            self._app = await self._retry(
                lambda: self.sdk.App.lookup.aio(self.options.app_name, create_if_missing=True),
                f"looking up app '{self.options.app_name}'",
            )
        return self._app

    def image(self, spec: SandboxSpec) -> Any:
        if spec.build is not None:
            dockerfile = spec.build.context_dir / spec.build.dockerfile
            if not dockerfile.is_file():
                raise SandboxError(f"modal: Dockerfile not found: {dockerfile}")
            return self.sdk.Image.from_dockerfile(dockerfile, context_dir=spec.build.context_dir)
        return self.sdk.Image.from_registry(spec.image or self.options.default_image)

    def create_kwargs(self, spec: SandboxSpec, labels: dict[str, str]) -> dict[str, Any]:
        r = spec.resources
        kwargs: dict[str, Any] = {
            "tags": labels,
            "timeout": math.ceil(spec.ttl_s) if spec.ttl_s else self.options.lifetime_s,
            "cpu": r.cpus,
            "memory": r.memory_mb,  # Modal takes MiB, like the spec
            **network_kwargs(spec),
        }
        if r.gpus:
            kwargs["gpu"] = f"{self.options.gpu}:{r.gpus}" if r.gpus > 1 else self.options.gpu
        return kwargs

    async def create(self, spec: SandboxSpec) -> RemoteSandbox:
        check_supported(spec, self.capabilities(), backend=self.name)
        sandbox_id = new_sandbox_id(self.name)
        labels = sandbox_labels(spec, sandbox_id=sandbox_id, run_id=run_id_for(spec, self.options.run_id))
        kwargs = self.create_kwargs(spec, labels)
        image = self.image(spec)
        app = await self.app()

        async def make() -> Any:
            try:
                return await self.sdk.Sandbox.create.aio(*KEEP_ALIVE, app=app, image=image, **kwargs)
            except Exception as exc:
                err = classify(exc, what="creating a sandbox", secrets=self._secrets)
                if type(err) is TransientError:  # the answer may be lost while the sandbox exists
                    await self._terminate_tagged({SANDBOX_LABEL: sandbox_id})
                raise err from exc

        sandbox = await self._retry(make, "creating a sandbox")
        return await start_remote_sandbox(
            ModalTransport(sandbox, secrets=self._secrets), spec, sandbox_id=sandbox_id, provider=self.name,
            isolation="container", options=self.options, live=self._live,
        )

    async def sweep(self, run_id: str) -> list[str]:
        """Terminate every sandbox of the app tagged with ``run_id``; return their miles ids."""
        return await self._terminate_tagged({RUN_LABEL: run_id})

    async def _terminate_tagged(self, tags: dict[str, str]) -> list[str]:
        app = await self.app()
        what = ", ".join(f"{k}={v}" for k, v in tags.items())

        async def listing() -> list[Any]:
            return [sb async for sb in self.sdk.Sandbox.list.aio(app_id=app.app_id, tags=tags)]

        removed: list[str] = []
        for sb in await self._retry(listing, f"listing sandboxes tagged {what}"):
            found = await self._retry(sb.get_tags.aio, f"reading the tags of sandbox {sb.object_id}")
            await self._retry(ModalTransport(sb, secrets=self._secrets).destroy, f"terminating sandbox {sb.object_id}")
            removed.append(found.get(SANDBOX_LABEL, sb.object_id))
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
                raise classify(exc, what=what, secrets=self._secrets) from exc

        try:
            return await retry_idempotent(attempt, what=f"modal: {what}", policy=self.options.retry)
        except Exception as exc:
            exc.args = tuple(redact(str(a), self._secrets) for a in exc.args)
            raise
