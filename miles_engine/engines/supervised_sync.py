"""The weight-sync calls of :class:`~miles_engine.engines.http.client.HttpEngine`, on a
:class:`~miles_engine.engines.supervisor.SupervisedEngine`: each goes to the live process.

- **Reads** (``fetch_weight_version``, ``weight_checksums``, ``get_weights_by_name``, ``keep_lora_base``:
  a new process keeps its freshly loaded base) wait out
  a restart and are re-sent to the new process.
- **Group calls** of the broadcast transport (``init_weights_update_group``,
  ``update_weights_from_distributed``, ``destroy_weights_update_group``) are sent once: a
  process-group member cannot be replaced mid-push, so a call whose process died (or was
  replaced meanwhile) raises :class:`EngineUnavailable` and the transport rebuilds its group
  (it compares :attr:`generation`). ``destroy`` never waits for a restart: the group died with
  the process.
- ``update_weights_from_disk_delta`` is recorded first (a restart re-syncs to it) and re-sent,
  with ``resync``, when its process died under it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_engine.engines.errors import EngineUnavailable

if TYPE_CHECKING:
    from miles_engine.engines.http.client import HttpEngine


class WeightSyncDelegation:
    name: str
    max_request_retries: int
    client: HttpEngine | None
    _generation: int
    _version: int
    _source: str
    _delta_sync: dict[str, Any] | None

    async def _live(self) -> HttpEngine: ...  # noqa: E704 - provided by SupervisedEngine
    async def _after_failure(self, generation: int) -> None: ...  # noqa: E704

    @property
    def is_miles_server(self) -> bool:
        """Our engine server (always, for a supervised ``server_command``), known after start."""
        return bool(self.client is not None and self.client.is_miles_server) or getattr(self, "_miles", False)

    @property
    def weight_checksums_supported(self) -> bool:
        """The live server hashes its own tensors (``weight_checksums``)."""
        return bool(self.client is not None and getattr(self.client, "weight_checksums_supported", False))

    @property
    def takes_flat_buckets(self) -> bool:
        return bool(self.client is not None and getattr(self.client, "takes_flat_buckets", False)) or self.is_miles_server

    @property
    def base_url(self) -> str | None:
        return self.client.base_url if self.client is not None else None

    async def _read(self, what: str, call: Any) -> Any:
        """An idempotent call on the live process, re-sent after a restart."""
        for _ in range(self.max_request_retries + 1):
            client = await self._live()
            generation = self._generation
            try:
                return await call(client)
            except EngineUnavailable:
                await self._after_failure(generation)
        raise EngineUnavailable(f"{self.name}: {what} failed {self.max_request_retries + 1} times (engine restarting)")

    async def fetch_weight_version(self) -> int:
        """The version the live process reports (refreshes :attr:`weight_version`)."""
        self._version = int(await self._read("get_weight_version", lambda c: c.fetch_weight_version()))
        return self._version

    async def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        return await self._read("weight_checksums", lambda c: c.weight_checksums(names))

    async def keep_lora_base(self, names: list[str]) -> dict[str, str]:
        return await self._read("lora_base", lambda c: c.keep_lora_base(names))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self._read("get_weights_by_name", lambda c: c.get_weights_by_name(name, truncate_size))

    # ------------------------------------------------------------------ broadcast group
    async def _once(self, what: str, call: Any, generation: int | None = None) -> Any:
        client = await self._live()
        gen = self._generation
        if generation is not None and gen != generation:
            raise EngineUnavailable(f"{self.name}: its process restarted (generation {generation} -> {gen}); "
                                    f"{what} needs the process that joined the group")
        try:
            result = await call(client)
        except EngineUnavailable as exc:
            await self._after_failure(gen)
            raise EngineUnavailable(f"{self.name}: {what}: {exc}") from None
        if self._generation != gen:
            raise EngineUnavailable(f"{self.name}: its process restarted during {what}")
        return result

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        await self._once("init_weights_update_group", lambda c: c.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name=group_name, backend=backend))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              *, generation: int | None = None, **kwargs: Any) -> None:
        """One bucket (see :meth:`HttpEngine.update_weights_from_distributed`); ``generation``: the
        process generation that joined the group (a replaced process raises at once)."""
        await self._once("update_weights_from_distributed",
                         lambda c: c.update_weights_from_distributed(names, dtypes, shapes, **kwargs), generation)
        version = kwargs.get("weight_version")
        if version is not None and kwargs.get("commit") is not False:
            self._version, self._source = int(version), "broadcast"

    async def commit_staged(self, *, group_name: str, weight_version: int, push_id: str,
                            generation: int | None = None) -> None:
        await self._once("commit_staged", lambda c: c.commit_staged(group_name=group_name,
                                                                    weight_version=weight_version, push_id=push_id),
                         generation)
        self._version, self._source = int(weight_version), "broadcast"

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        client = self.client
        if client is None:
            raise EngineUnavailable(f"{self.name} is restarting: its group died with its process")
        await client.destroy_weights_update_group(group_name)

    # ------------------------------------------------------------------ disk_delta
    async def update_weights_from_disk_delta(self, publish_root: str, version: int, *, engine: str,
                                             resync: bool = False, **kwargs: Any) -> dict[str, Any]:
        previous = (self._delta_sync, self._source)
        # recorded first: a restart from here on re-syncs the new process to this version
        self._delta_sync = {"publish_root": publish_root, "version": int(version), "engine": engine, **kwargs}
        self._source = "disk_delta"
        try:
            for attempt in range(self.max_request_retries + 1):
                client = await self._live()
                generation = self._generation
                try:
                    answer = await client.update_weights_from_disk_delta(
                        publish_root, version, engine=engine, resync=resync or attempt > 0, **kwargs)
                    break
                except EngineUnavailable:
                    await self._after_failure(generation)
            else:
                raise EngineUnavailable(f"{self.name}: disk_delta sync to version {version} failed "
                                        f"{self.max_request_retries + 1} times (engine restarting)")
        except BaseException:
            self._delta_sync, self._source = previous
            raise
        self._version = int(answer["weight_version"])
        return answer
