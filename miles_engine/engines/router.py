"""An in-process router in front of several RolloutEngines (embedded engines, HTTP clients or
supervised engine processes); it is itself a RolloutEngine.

- **Session affinity**: every turn of a session goes to the engine that served its previous
  turn (it holds the prefix cache). The map is an LRU of at most ``max_sessions`` entries;
  :meth:`end_session` forgets a session so finished sessions stop skewing placement.
- **Least-loaded placement** for new sessions and session-less requests: fewest in-flight
  tokens (prompt + ``max_new_tokens`` of requests not yet returned), then fewest pinned
  sessions, then fewest requests placed so far.
- **Health quarantine**: an engine whose ``health()`` fails ``fail_threshold`` periodic checks,
  or whose ``generate`` raises :class:`EngineUnavailable`, gets no new work; its sessions move on
  their next turn (a request whose engine became unavailable is re-sent to another admitted
  engine, up to ``retry_unavailable`` times). After ``readmit_after`` good checks it is
  re-admitted, first brought to the current weights (``restore``: an async callable returning
  ``(named tensors, version)``, e.g. the trainer's; else the weights last pushed through the
  router) when the version it reports differs, and to the pause state. The router never
  starts, restarts or kills an engine: fit for ``external`` servers; a
  :class:`~miles_engine.engines.supervisor.SupervisedEngine` restarts itself.
- **Fleet health**: :attr:`no_healthy_since` is when the last admitted engine was quarantined
  (None while one is admitted); :meth:`raise_if_unhealthy_for` turns a long outage into one
  :class:`NoHealthyEngine` error naming every engine's last error.
- **Metrics** per step (:meth:`metrics`): ``engines/<name>/{inflight, requests, output_tokens,
  tokens_per_s, failures, restarts, quarantined, weight_version}`` and the totals
  ``engines/{healthy, quarantined, restarts, requests, tokens_per_s}``; counts are since the
  previous call, ``restarts`` is the engine's running total (SupervisedEngine.restarts). Engines
  that say what a push's pause did to their running requests (``pause_counts``: our servers) add
  ``engines/<name>/{retracted, kept_in_place, aborted}`` and their totals.
- **Fan-out**: pause / resume / update_weights go to every admitted engine; ``weight_version``
  is the minimum over admitted engines (they agree unless an update is in progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.engines.errors import EngineUnavailable
from miles_engine.engines.protocol import (
    PAUSE_EFFECTS,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    RolloutEngine,
    TensorMeta,
    engine_version,
)

log = logging.getLogger(__name__)

Restore = Callable[[], Awaitable[tuple[Mapping[str, Any], int]]]


class NoHealthyEngine(EngineUnavailable):
    """No engine behind the router has been healthy for longer than the run tolerates."""


@dataclass
class EngineSlot:
    name: str
    engine: RolloutEngine
    healthy: bool = True
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> token cost
    sessions: int = 0
    placed: int = 0
    ok_streak: int = 0
    fail_streak: int = 0
    last_error: str | None = None
    requests: int = 0  # completed, running totals (metrics() reports the change since its last call)
    output_tokens: int = 0
    failures: int = 0
    reported: tuple[int, int, int] = (0, 0, 0)  # (requests, output_tokens, failures) at the last metrics()
    reported_pauses: dict[str, int] = field(default_factory=dict)  # the engine's pause_counts at the last metrics()

    @property
    def inflight_tokens(self) -> int:
        return sum(self.inflight.values())


class Router:
    def __init__(self, engines: Sequence[RolloutEngine] | Mapping[str, RolloutEngine], *,
                 health_interval_s: float = 2.0, health_timeout_s: float = 5.0, fail_threshold: int = 2,
                 readmit_after: int = 2, max_sessions: int = 100_000, restore: Restore | None = None,
                 retry_unavailable: int = 1) -> None:
        items = engines.items() if isinstance(engines, Mapping) else ((getattr(e, "name", f"engine{i}"), e)
                                                                      for i, e in enumerate(engines))
        self.slots = [EngineSlot(str(n), e) for n, e in items]
        if not self.slots:
            raise ValueError("a router needs at least one engine")
        if len({s.name for s in self.slots}) != len(self.slots):
            self.slots = [EngineSlot(f"{s.name}#{i}", s.engine) for i, s in enumerate(self.slots)]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.fail_threshold = fail_threshold
        self.readmit_after = readmit_after
        self.max_sessions = max_sessions
        self.restore = restore
        self.retry_unavailable = retry_unavailable
        self.no_healthy_since: float | None = None  # time.monotonic() when the last admitted engine left
        self.epoch = 0  # bumped on every quarantine and re-admission (a broadcast group then rebuilds)
        self._metrics_at = time.monotonic()
        self._affinity: OrderedDict[str, EngineSlot] = OrderedDict()
        self._rid_slot: dict[str, EngineSlot] = {}
        self._version = min(s.engine.weight_version for s in self.slots)
        self._last_weights: Mapping[str, Any] | Path | None = None
        self._paused: PauseMode | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._admin = asyncio.Lock()
        # held by a weight push from start to record (weights_held) and by a re-admission's
        # restore: an engine re-admitted mid-push never loads the previous version over the new one.
        # Order: _weights before _admin.
        self._weights = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> Router:
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="router-health")
        return self

    async def aclose(self) -> None:
        await self.stop_health_checks()
        await asyncio.gather(*(s.engine.aclose() for s in self.slots), return_exceptions=True)

    async def stop_health_checks(self) -> None:
        """Stop the health loop, leaving the engines to whoever started them."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None

    # ------------------------------------------------------------------ placement
    def _admitted(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.healthy]

    def _unpin(self, session_id: str) -> None:
        slot = self._affinity.pop(session_id, None)
        if slot is not None:
            slot.sessions -= 1

    def pick(self, session_id: str | None) -> EngineSlot:
        if session_id is not None and session_id in self._affinity:
            slot = self._affinity[session_id]
            if slot.healthy:
                self._affinity.move_to_end(session_id)
                return slot
            self._unpin(session_id)  # its engine is quarantined: the session moves (prefix lost)
        admitted = self._admitted()
        if not admitted:
            raise EngineUnavailable(f"no healthy engine behind the router: {self._errors()}")
        slot = min(admitted, key=lambda s: (s.inflight_tokens, s.sessions, s.placed))
        if session_id is not None:
            self._affinity[session_id] = slot
            slot.sessions += 1
            while len(self._affinity) > self.max_sessions:
                self._unpin(next(iter(self._affinity)))
        return slot

    def end_session(self, session_id: str) -> None:
        """Forget a finished session's affinity (its engine may still keep the cache a while)."""
        self._unpin(session_id)

    def session_engine(self, session_id: str) -> str | None:
        slot = self._affinity.get(session_id)
        return slot.name if slot else None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        for attempt in range(self.retry_unavailable + 1):
            slot = self.pick(request.session_id)
            slot.inflight[request.request_id] = len(request.input_ids) + request.sampling.max_new_tokens
            slot.placed += 1
            self._rid_slot[request.request_id] = slot
            try:
                result = await slot.engine.generate(request)
            except EngineUnavailable as exc:
                slot.failures += 1
                self._quarantine(slot, str(exc))
                if attempt >= self.retry_unavailable or not self._admitted():
                    raise
                log.warning("router: %s lost request %s (%s); re-sending it elsewhere", slot.name,
                            request.request_id, exc)
                continue
            finally:
                slot.inflight.pop(request.request_id, None)
                self._rid_slot.pop(request.request_id, None)
            slot.requests += 1
            slot.output_tokens += len(result.output_ids)
            result.info.setdefault("engine", slot.name)
            if attempt:
                result.info["router_retries"] = attempt
            return result
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ health
    def _quarantine(self, slot: EngineSlot, reason: str) -> None:
        if slot.healthy:
            log.warning("router: quarantining %s: %s", slot.name, reason)
            self.epoch += 1
        slot.healthy, slot.ok_streak, slot.last_error = False, 0, reason
        if self.no_healthy_since is None and not self._admitted():
            self.no_healthy_since = time.monotonic()
            log.error("router: no healthy engine left (%s)", self._errors())

    def _errors(self) -> str:
        return "; ".join(f"{s.name}: {s.last_error}" for s in self.slots)

    def raise_if_unhealthy_for(self, seconds: float, *, key: str = "") -> None:
        """Raise :class:`NoHealthyEngine` when no engine has been admitted for over ``seconds``
        (``key``: the setting that set the limit, named in the error)."""
        since = self.no_healthy_since
        if since is not None and time.monotonic() - since > seconds:
            limit = f"{key}={seconds:g}s" if key else f"limit {seconds:g}s"
            raise NoHealthyEngine(f"no engine behind the router has been healthy for "
                                  f"{time.monotonic() - since:.0f}s ({limit}): {self._errors()}")

    async def _probe(self, slot: EngineSlot) -> bool:
        try:
            return bool(await asyncio.wait_for(slot.engine.health(), self.health_timeout_s))
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            slot.last_error = f"health: {exc.__class__.__name__}: {exc}"
            return False

    async def check_health(self) -> None:
        """One round of health checks (the background loop calls this every interval)."""
        results = await asyncio.gather(*(self._probe(s) for s in self.slots))
        for slot, ok in zip(self.slots, results):
            if slot.healthy:
                slot.fail_streak = 0 if ok else slot.fail_streak + 1
                if slot.fail_streak >= self.fail_threshold:
                    self._quarantine(slot, slot.last_error or "health check failed")
            elif ok:
                slot.ok_streak += 1
                if slot.ok_streak >= self.readmit_after:
                    await self._readmit(slot)
            else:
                slot.ok_streak = 0

    def weights_held(self) -> asyncio.Lock:
        """``async with router.weights_held():`` around a push and the recording of what it pushed."""
        return self._weights

    async def _readmit(self, slot: EngineSlot) -> None:
        async with self._weights, self._admin:
            try:
                current = await engine_version(slot.engine)  # asked, not a client's cache: it may have restarted
                target = self._current_version()
                if current != target:
                    if self.restore is not None:
                        tensors, target = await self.restore()
                        await slot.engine.update_weights(tensors, version=int(target))
                    elif self._last_weights is not None and target == self._version:
                        await slot.engine.update_weights(self._last_weights, version=self._version)
                    else:
                        raise ValueError(f"at version {current}, the fleet at {target}, and no restore callback "
                                         f"or weights to re-push")
                if self._paused is not None:
                    await slot.engine.pause(self._paused)
            except Exception as exc:  # noqa: BLE001 - stays quarantined, retried next round
                slot.ok_streak, slot.last_error = 0, f"readmission: {exc}"
                log.warning("router: cannot readmit %s: %s", slot.name, exc)
                return
            slot.healthy, slot.fail_streak, slot.last_error = True, 0, None
            self.no_healthy_since = None
            self.epoch += 1
            log.info("router: readmitted %s", slot.name)

    def _current_version(self) -> int:
        """The fleet's version: what was pushed through the router, or what admitted engines serve
        (a transport pushing to the engines directly moves them, not the router)."""
        return max([self._version, *(s.engine.weight_version for s in self._admitted())])

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must survive
                log.exception("router health round failed")

    # ------------------------------------------------------------------ fan-out
    async def _fan_out(self, what: str, call: Any) -> list[Any]:
        slots = self._admitted()
        results = await asyncio.gather(*(call(s.engine) for s in slots), return_exceptions=True)
        errors = []
        for slot, res in zip(slots, results):
            if isinstance(res, EngineUnavailable):
                self._quarantine(slot, f"{what}: {res}")
            elif isinstance(res, BaseException):
                errors.append((slot, res))
        if errors:
            slot, exc = errors[0]
            raise type(exc)(f"{what} failed on {slot.name}: {exc}") if isinstance(exc, ValueError) else exc
        return [r for r in results if not isinstance(r, BaseException)]

    @property
    def weight_version(self) -> int:
        admitted = self._admitted()
        return min(s.engine.weight_version for s in admitted) if admitted else self._version

    def versions(self) -> dict[str, int]:
        return {s.name: s.engine.weight_version for s in self.slots}

    async def pause(self, mode: PauseMode = "retract") -> None:
        async with self._admin:
            self._paused = mode
            await self._fan_out("pause", lambda e: e.pause(mode))

    async def resume(self) -> None:
        async with self._admin:
            self._paused = None
            await self._fan_out("resume", lambda e: e.resume())

    async def update_weights(self, weights: Mapping[str, Any] | Path, *, version: int | None = None) -> int:
        async with self._admin:
            target = self.weight_version + 1 if version is None else int(version)
            await self._fan_out("update_weights", lambda e: e.update_weights(weights, version=target))
            self._version, self._last_weights = target, weights
            return target

    async def abort(self, request_id: str) -> bool:
        slot = self._rid_slot.get(request_id)
        return bool(slot and await slot.engine.abort(request_id))

    def weight_metadata(self) -> list[TensorMeta]:
        return (self._admitted() or self.slots)[0].engine.weight_metadata()

    async def health(self) -> bool:
        return any(s.healthy for s in self.slots)

    def metrics(self, prefix: str = "engines") -> dict[str, float]:
        """Flat per-engine figures since the previous call (see the module docstring)."""
        now = time.monotonic()
        elapsed = max(now - self._metrics_at, 1e-9)
        self._metrics_at = now
        out: dict[str, float] = {}
        total_requests = total_tokens = total_restarts = 0
        total_pauses: dict[str, float] = {}
        for s in self.slots:
            requests, tokens, failures = (a - b for a, b in zip((s.requests, s.output_tokens, s.failures),
                                                                 s.reported))
            s.reported = (s.requests, s.output_tokens, s.failures)
            restarts = int(getattr(s.engine, "restarts", 0) or 0)
            key = f"{prefix}/{s.name}"
            out.update({f"{key}/inflight": float(len(s.inflight)), f"{key}/requests": float(requests),
                        f"{key}/output_tokens": float(tokens), f"{key}/tokens_per_s": tokens / elapsed,
                        f"{key}/failures": float(failures), f"{key}/restarts": float(restarts),
                        f"{key}/quarantined": 0.0 if s.healthy else 1.0,
                        f"{key}/weight_version": float(s.engine.weight_version)})
            counts = dict(getattr(s.engine, "pause_counts", None) or {})
            for what in PAUSE_EFFECTS:  # engines that report what pauses did (our servers, supervised)
                if what in counts:
                    n = float(counts[what] - s.reported_pauses.get(what, 0))
                    out[f"{key}/{what}"] = n
                    total_pauses[what] = total_pauses.get(what, 0.0) + n
            s.reported_pauses = counts
            total_requests += requests
            total_tokens += tokens
            total_restarts += restarts
        healthy = len(self._admitted())
        out.update({f"{prefix}/healthy": float(healthy), f"{prefix}/quarantined": float(len(self.slots) - healthy),
                    f"{prefix}/restarts": float(total_restarts), f"{prefix}/requests": float(total_requests),
                    f"{prefix}/tokens_per_s": total_tokens / elapsed,
                    **{f"{prefix}/{what}": n for what, n in total_pauses.items()}})
        return out

    def stats(self) -> list[dict[str, Any]]:
        return [{"engine": s.name, "healthy": s.healthy, "inflight_tokens": s.inflight_tokens,
                 "inflight_requests": len(s.inflight), "sessions": s.sessions, "placed": s.placed,
                 "weight_version": s.engine.weight_version, "last_error": s.last_error} for s in self.slots]
