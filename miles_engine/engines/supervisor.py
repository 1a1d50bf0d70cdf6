"""Fault tolerance for an engine *process*: :class:`SupervisedEngine` runs our HTTP server
(``python -m miles_engine.run.engine_server``) as a subprocess and is itself a RolloutEngine.

- **Detect**: a monitor polls the process (and ``/health`` every ``health_interval_s``); a
  ``generate`` whose connection drops also triggers a check.
- **Restart** in a fresh process group, then **re-apply the current weights at the same
  version**, whatever transport pushed them, and the pause state:

  * with ``restore`` (an async callable returning ``(named tensors, version)``, typically the
    trainer's current weights): they are loaded over ``update_weights`` at that version;
  * else, when the last push was a disk_delta sync: the engine re-syncs from the publish root
    (``resync``: baseline, or its local copy, replayed to the version, loaded in full);
  * else the snapshot of what went through :meth:`update_weights` (in-memory pushes are merged
    into ``state_dir/weights_vNNNNNN/model.safetensors``; a pushed directory is remembered by path
    and must stay until the next push), at *its* version: after a broadcast push without
    ``restore`` that is an older version, reported as such (never new weights' version on old
    weights).

  :attr:`generation` counts process starts (1 after :meth:`start`), :attr:`restarts` the
  successful restarts. The weight-sync calls of :class:`HttpEngine` are delegated to the live
  process (:mod:`.supervised_sync`).
- **Retry in-flight requests**: a ``generate`` that lost its engine waits for the restart and
  re-sends the *original* request (same prompt, session and sampling params, seed included;
  on the wire its rid gets a ``~retryN`` suffix, the result carries the original id). The regenerated
  tokens replace the lost partial ones, so log-probs and per-token weight versions all come
  from the new run; ``result.info["retries"]`` counts the re-sends. Requests the caller
  aborted are not retried (they return ``finish_reason="abort"``).
- **Crash loops** back off exponentially (``backoff_base_s * 2**k`` up to ``backoff_max_s``); after
  ``max_restarts`` consecutive failures (a run longer than ``stable_after_s`` resets the count)
  every call raises :class:`EngineCrashLoop` with the server's log tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_engine.engines.errors import EngineCrashLoop, EngineUnavailable
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.http.tensors import untied_cpu
from miles_engine.engines.launch import ServerProcess
from miles_engine.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TensorMeta,
)
from miles_engine.engines.supervised_sync import WeightSyncDelegation

log = logging.getLogger(__name__)

Restore = Callable[[], Awaitable[tuple[Mapping[str, Any], int]]]


class SupervisedEngine(WeightSyncDelegation):
    def __init__(self, command: Sequence[str], *, name: str = "engine", state_dir: str | Path | None = None,
                 start_timeout_s: float = 120.0, max_restarts: int = 5, backoff_base_s: float = 0.5,
                 backoff_max_s: float = 30.0, stable_after_s: float = 60.0, monitor_interval_s: float = 0.2,
                 health_interval_s: float = 5.0, health_failures: int = 3, max_request_retries: int = 3,
                 env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 client_kwargs: Mapping[str, Any] | None = None, restore: Restore | None = None,
                 process_factory: Callable[..., Any] | None = None,
                 client_factory: Callable[..., HttpEngine] = HttpEngine) -> None:
        self.name = name
        self.restore = restore
        self._own_state = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix=f"miles-{name}-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [*command, "--port", "0", "--port-file", str(self.state_dir / "port")]
        # process_factory: where the server runs (default: a subprocess here; a Ray actor under placement.backend=ray)
        self.process = (process_factory or ServerProcess)(argv, port_file=self.state_dir / "port", env=env, cwd=cwd,
                                                          log_path=self.state_dir / "server.log", name=name)
        self.start_timeout_s, self.max_restarts = start_timeout_s, max_restarts
        self.backoff_base_s, self.backoff_max_s, self.stable_after_s = backoff_base_s, backoff_max_s, stable_after_s
        self.monitor_interval_s, self.health_interval_s = monitor_interval_s, health_interval_s
        self.health_failures, self.max_request_retries = health_failures, max_request_retries
        self.client_kwargs = dict(client_kwargs or {})
        self.client_factory = client_factory  # the server's API: ours / SGLang's (HttpEngine), vLLM's (VllmEngine)
        self.client: HttpEngine | None = None
        self.restarts = 0  # successful restarts
        self.pause_counts: Counter[str] = Counter()  # what pauses did to running requests, over every process
        self.backoffs: list[float] = []  # every backoff slept, for tests and metrics
        self._crashes = 0  # consecutive failures
        self._up_since = 0.0
        self._generation = 0
        self._ready = asyncio.Event()
        self._failed: EngineCrashLoop | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._closing = False
        self._version = 0
        self._weights: Path | None = None  # the update_weights snapshot ...
        self._weights_version = 0  # ... and the version it holds
        # whether a fresh process (initial weights) plus the snapshot make the snapshot's version
        self._complete = True
        self._owned_weights: Path | None = None
        self._source = "initial"  # what pushed the current weights: initial, update_weights, broadcast, disk_delta
        self._delta_sync: dict[str, Any] | None = None  # the last disk_delta sync call (re-sent after a restart)
        self._metadata: list[TensorMeta] = []
        self._miles = False
        self._paused: PauseMode | None = None
        self._aborts: dict[str, asyncio.Event] = {}  # in-flight request id -> set when the caller aborts it
        self._wire_rids: dict[str, str] = {}  # request id -> the rid of its current attempt on the server

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> SupervisedEngine:
        await self._launch()
        self._version = self.client.weight_version  # type: ignore[union-attr]
        self._ready.set()
        self._monitor_task = asyncio.create_task(self._monitor(), name=f"{self.name}-monitor")
        return self

    async def _launch(self) -> None:
        self.process.spawn()
        await self.process.wait_ready(self.start_timeout_s)
        client = self.client_factory(self.process.url, name=self.name, **self.client_kwargs)
        try:
            await client.connect()
            if self._generation:  # a restart: bring the new process to the current weights
                self._version = await self._reapply(client)
            if self._paused is not None:
                await client.pause(self._paused)
        except BaseException:
            await client.aclose()
            self.process.kill()
            raise
        self.client, self._up_since = client, time.monotonic()
        self._metadata, self._miles = client.weight_metadata(), client.is_miles_server
        self._generation += 1

    async def _reapply(self, client: HttpEngine) -> int:
        """Load the current weights into a restarted process; returns the version it serves."""
        if self.restore is not None:
            tensors, version = await self.restore()
            return await client.update_weights(tensors, version=int(version))
        if self._source == "disk_delta" and self._delta_sync is not None:
            answer = await client.update_weights_from_disk_delta(**{**self._delta_sync, "resync": True})
            return int(answer["weight_version"])
        if self._weights is not None and self._complete:
            if self._source != "update_weights":
                log.warning("%s: restarted without a restore callback after a %s push: it serves its last "
                            "update_weights snapshot, version %d", self.name, self._source, self._weights_version)
            return await client.update_weights(self._weights, version=self._weights_version)
        if self._source != "initial":
            log.warning("%s: restarted without a restore callback (or a complete snapshot) after a %s push: it "
                        "serves its initial "
                        "weights, version %d", self.name, self._source, client.weight_version)
        return client.weight_version

    @property
    def generation(self) -> int:
        """Process starts so far (1 after :meth:`start`); changes on every restart."""
        return self._generation

    async def aclose(self) -> None:
        self._closing = True
        for task in (self._monitor_task, self._restart_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.client is not None:
            await self.client.aclose()
        await self.process.stop(grace_s=5.0)
        if self._own_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ------------------------------------------------------------------ failure handling
    def _trigger_restart(self, reason: str) -> None:
        if self._closing or self._failed is not None or (self._restart_task and not self._restart_task.done()):
            return
        log.warning("%s: restarting engine process: %s", self.name, reason)
        self._ready.clear()
        self._restart_task = asyncio.create_task(self._restart(reason), name=f"{self.name}-restart")

    async def _restart(self, reason: str) -> None:
        if time.monotonic() - self._up_since > self.stable_after_s:
            self._crashes = 0
        self.process.kill()  # first: every open connection to it fails now
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        while True:
            self._crashes += 1
            if self._crashes > self.max_restarts:
                self._failed = EngineCrashLoop(
                    f"{self.name}: engine process failed {self._crashes - 1} restarts in a row (last: {reason}); "
                    f"giving up. Log {self.process.log_path}:\n{self.process.log_tail()}")
                log.error("%s", self._failed)
                self._ready.set()
                return
            delay = min(self.backoff_base_s * 2 ** (self._crashes - 1), self.backoff_max_s)
            self.backoffs.append(delay)
            await asyncio.sleep(delay)
            try:
                await self._launch()
            except Exception as exc:  # noqa: BLE001 - any failed start counts as a crash
                reason = f"restart failed: {type(exc).__name__}: {exc}".splitlines()[0]
                log.warning("%s: %s", self.name, reason, exc_info=True)
                continue
            self.restarts += 1
            self._ready.set()
            return

    async def _monitor(self) -> None:
        last_health, failures = time.monotonic(), 0
        while not self._closing:
            await asyncio.sleep(self.monitor_interval_s)
            if not self._ready.is_set() or self._failed is not None:
                continue
            if not self.process.alive():
                self._trigger_restart(f"process exited with code {self.process.returncode}")
                continue
            client = self.client
            if time.monotonic() - last_health >= self.health_interval_s and client is not None:
                last_health = time.monotonic()
                failures = 0 if await client.health() else failures + 1
                if failures >= self.health_failures and client is self.client:
                    failures = 0
                    self._trigger_restart(f"{self.health_failures} failed health checks")

    async def _client(self, aborted: asyncio.Event | None = None) -> HttpEngine | None:
        """The live client, waiting out a restart; ``None`` if ``aborted`` is set meanwhile."""
        while True:
            if self._failed is not None:
                raise self._failed
            if aborted is not None and aborted.is_set():
                return None
            if self._ready.is_set() and self.client is not None:
                return self.client
            waits = [asyncio.ensure_future(self._ready.wait())]
            if aborted is not None:
                waits.append(asyncio.ensure_future(aborted.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _live(self) -> HttpEngine:
        client = await self._client()
        assert client is not None
        return client

    async def _after_failure(self, generation: int) -> None:
        """A call lost its connection: restart unless the process is healthy (or already restarted)."""
        if generation != self._generation or not self._ready.is_set():
            return
        if not self.process.alive() or self.client is None or not await self.client.health():
            self._trigger_restart("a request lost its connection")

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        retries = 0
        rid = request.request_id
        aborted = self._aborts[rid] = asyncio.Event()
        wire_req = request
        try:
            while True:
                client = await self._client(aborted)
                if client is None:
                    return GenerateResult(rid, [], [], [], "abort", len(request.input_ids),
                                          info={"abort_message": "aborted while its engine restarted",
                                                "retries": retries})
                generation = self._generation
                self._wire_rids[rid] = wire_req.request_id
                try:
                    result = await client.generate(wire_req)
                except EngineUnavailable:
                    retries += 1
                    if retries > self.max_request_retries:
                        raise
                    await self._after_failure(generation)
                    if generation == self._generation and self._ready.is_set():
                        # same process still up: stop the lost attempt, re-send under a fresh wire id
                        with contextlib.suppress(Exception):
                            await client.abort(wire_req.request_id)
                    wire_req = dataclasses.replace(request, request_id=f"{rid}~retry{retries}")
                    continue
                result.request_id = rid
                result.info["retries"] = retries
                return result
        finally:
            self._aborts.pop(rid, None)
            self._wire_rids.pop(rid, None)

    async def pause(self, mode: PauseMode = "retract") -> None:
        self._paused = mode
        client = await self._live()
        before = Counter(getattr(client, "pause_counts", {}))
        await client.pause(mode)
        self.pause_counts.update(Counter(getattr(client, "pause_counts", {})) - before)

    async def resume(self) -> None:
        self._paused = None
        await (await self._live()).resume()

    async def abort(self, request_id: str) -> bool:
        event = self._aborts.get(request_id)
        if event is None:
            return False
        event.set()
        if not self._ready.is_set() or self.client is None:
            return True  # it is waiting for a restart and returns "abort" now
        try:
            return await self.client.abort(self._wire_rids.get(request_id, request_id))
        except EngineUnavailable:
            return True

    async def update_weights(self, weights: Mapping[str, Any] | Path, *, version: int | None = None) -> int:
        target = self._version + 1 if version is None else int(version)
        previous = (self._weights, self._owned_weights, self._weights_version, self._complete, self._version,
                    self._source)
        if isinstance(weights, (str, Path)):
            path, owned, complete, payload = Path(weights), None, True, Path(weights)
        else:
            # merged into the snapshot only while the snapshot is current (not after another transport's push)
            base = self._source in ("initial", "update_weights") and self._complete
            path = owned = await asyncio.to_thread(self._save, weights, target, base)
            complete = base or {m.name for m in self._metadata} <= set(weights)
            payload = weights  # only these tensors go to the process
        # Recorded first: a restart from here on re-applies these weights at this version.
        self._weights, self._owned_weights, self._weights_version, self._complete = path, owned, target, complete
        self._version, self._source = target, "update_weights"
        try:
            for _ in range(self.max_request_retries + 1):
                client = await self._live()
                generation = self._generation
                try:
                    await client.update_weights(payload, version=target)
                    break
                except EngineUnavailable:
                    await self._after_failure(generation)
                    await self._live()
                    if self._generation != generation:
                        break  # the restarted process loaded them
            else:
                raise EngineUnavailable(f"{self.name}: could not push weights v{target}")
        except Exception:
            (self._weights, self._owned_weights, self._weights_version, self._complete, self._version,
             self._source) = previous
            if owned is not None and owned != previous[1]:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        if previous[1] is not None and previous[1] != owned:
            shutil.rmtree(previous[1], ignore_errors=True)
        return target

    def _save(self, weights: Mapping[str, Any], version: int, merge: bool) -> Path:
        """Write the snapshot of ``version`` (``merge``: over the previous snapshot's tensors)."""
        from safetensors.torch import load_file, save_file

        named = untied_cpu(weights)
        if merge and self._weights is not None and (self._weights / "model.safetensors").is_file():
            named = {**load_file(str(self._weights / "model.safetensors")), **named}
        final = self.state_dir / f"weights_v{version:06d}"
        tmp = self.state_dir / f".tmp_weights_v{version:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(named, str(tmp / "model.safetensors"))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def weight_metadata(self) -> list[TensorMeta]:
        return list(self._metadata)

    async def health(self) -> bool:
        if self._failed is not None or not self._ready.is_set() or self.client is None:
            return False
        return await self.client.health()
