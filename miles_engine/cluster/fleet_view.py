"""The driver's fleet decisions as a session-server actor sees them.

The driver's :class:`~miles_engine.engines.router.Router` stays the one owner of the fleet: it
quarantines and re-admits engines (bringing each to the current weights first, never during a
push: ``weights_held``), and the engine supervisors restart dead engines with the current
weights. :func:`fleet_view` snapshots that — per engine its serving URL (None while it
restarts), process generation, admitted state and weight version; the fleet's version and
whether a push holds the weights — and the driver pushes every change to the actors.

In an actor, :class:`ViewRouter` is the session server's engine: it routes like the driver's
router (session affinity, then least in-flight tokens) over the engines the last view admits,
never to one the driver quarantined. An engine that does not answer is skipped by this actor
for ``retry_after_s`` and the request re-sent to another admitted engine (the driver's router
does the same); with none admitted the request waits for the driver's next view up to
``wait_s``, then fails as "engine unavailable" (the agent's client retries the turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_engine.engines.errors import EngineUnavailable
from miles_engine.engines.protocol import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineView:
    name: str
    url: str | None  # None: not serving (its process is restarting)
    generation: int  # process starts: a new one is a new server (a new URL)
    admitted: bool  # the driver's router routes to it
    version: int  # the weight version it serves


@dataclass(frozen=True)
class FleetView:
    engines: tuple[EngineView, ...]
    version: int  # the fleet's weight version (the driver router's)
    held: bool  # a weight push (or a re-admission's restore) holds the weights
    serial: int = 0  # set by the driver: an actor ignores a view older than the one it has


def fleet_view(router: Any) -> FleetView:
    """What the driver's router decides now (``serial`` left 0)."""
    engines = []
    for slot in router.slots:
        e = slot.engine
        url = e.base_url if hasattr(e, "base_url") else None
        engines.append(EngineView(slot.name, url, int(getattr(e, "generation", 0) or 0), bool(slot.healthy),
                                  int(e.weight_version)))
    return FleetView(tuple(engines), int(router.weight_version), router.weights_held().locked())


@dataclass
class _Engine:
    view: EngineView
    client: Any
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> token cost
    sessions: int = 0
    placed: int = 0
    unreachable_until: float = 0.0

    def routable(self, now: float) -> bool:
        return self.view.admitted and self.view.url is not None and now >= self.unreachable_until


def _http_client(view: EngineView) -> Any:
    from miles_engine.engines.http.client import HttpEngine

    return HttpEngine(str(view.url), name=view.name)


class ViewRouter:
    """A RolloutEngine for the session server inside an actor (generate / abort / end_session)."""

    def __init__(self, client_factory: Callable[[EngineView], Any] = _http_client, *, wait_s: float = 120.0,
                 retry_after_s: float = 2.0, retry_unavailable: int = 1, max_sessions: int = 100_000) -> None:
        self.client_factory = client_factory
        self.wait_s, self.retry_after_s = wait_s, retry_after_s
        self.retry_unavailable, self.max_sessions = retry_unavailable, max_sessions
        self.view: FleetView | None = None
        self.engines: dict[str, _Engine] = {}
        self.counts: Counter[str] = Counter()
        # per engine name, over its restarts: [completed requests, their sampled tokens, lost to it unreachable]
        self.served: dict[str, list[int]] = {}
        self._affinity: OrderedDict[str, _Engine] = OrderedDict()
        self._rid: dict[str, _Engine] = {}
        self._aborted: set[str] = set()
        self._changed = asyncio.Event()

    async def apply(self, view: FleetView) -> int:
        """Take the driver's view (an older one than held is ignored); returns the serial held."""
        if self.view is not None and view.serial <= self.view.serial:
            return self.view.serial
        stale = []
        for ev in view.engines:
            cur = self.engines.get(ev.name)
            if cur is None or (cur.view.url, cur.view.generation) != (ev.url, ev.generation):
                if cur is not None:
                    stale.append(cur.client)
                self.engines[ev.name] = _Engine(ev, self.client_factory(ev) if ev.url else None)
            else:
                cur.view = ev
        for name in set(self.engines) - {ev.name for ev in view.engines}:
            stale.append(self.engines.pop(name).client)
        self.view = view
        self.counts["views"] += 1
        self._changed.set()
        self._changed = asyncio.Event()
        for client in stale:  # requests still on them finish or fail on their own
            if client is not None:
                asyncio.get_running_loop().call_later(30, _close_later, client)
        return view.serial

    @property
    def weight_version(self) -> int:
        return self.view.version if self.view is not None else 0

    def admitted(self) -> list[str]:
        now = time.monotonic()
        return [name for name, e in self.engines.items() if e.routable(now)]

    # ------------------------------------------------------------------ placement (as the driver's router)
    def _unpin(self, session_id: str) -> None:
        e = self._affinity.pop(session_id, None)
        if e is not None:
            e.sessions -= 1

    def _pick(self, session_id: str | None) -> _Engine | None:
        now = time.monotonic()
        if session_id is not None and session_id in self._affinity:
            e = self._affinity[session_id]
            if e.routable(now) and self.engines.get(e.view.name) is e:
                self._affinity.move_to_end(session_id)
                return e
            self._unpin(session_id)  # quarantined, restarted or unreachable: the session moves
        routable = [e for e in self.engines.values() if e.routable(now)]
        if not routable:
            return None
        e = min(routable, key=lambda x: (sum(x.inflight.values()), x.sessions, x.placed))
        if session_id is not None:
            self._affinity[session_id] = e
            e.sessions += 1
            while len(self._affinity) > self.max_sessions:
                self._unpin(next(iter(self._affinity)))
        return e

    async def _wait_pick(self, request: GenerateRequest) -> _Engine | None:
        """An admitted engine, waiting for the driver's next view while none is."""
        deadline = time.monotonic() + self.wait_s
        while True:
            e = self._pick(request.session_id)
            if e is not None or request.request_id in self._aborted:
                return e
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(f"no engine admitted by the driver within {self.wait_s:g}s: "
                                        f"{self._describe()}")
            self.counts["waits"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, self.retry_after_s))

    def _describe(self) -> str:
        return "; ".join(f"{e.view.name}: {'admitted' if e.view.admitted else 'quarantined'}"
                         f"{'' if e.view.url else ', restarting'}" for e in self.engines.values()) or "no engines"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.request_id
        try:
            for attempt in range(self.retry_unavailable + 1):
                e = await self._wait_pick(request)
                if e is None:  # aborted (its session was deleted) while waiting
                    return GenerateResult(rid, [], [], [], "abort", len(request.input_ids))
                e.inflight[rid] = len(request.input_ids) + request.sampling.max_new_tokens
                e.placed += 1
                self._rid[rid] = e
                try:
                    result = await e.client.generate(request)
                except EngineUnavailable as exc:
                    e.unreachable_until = time.monotonic() + self.retry_after_s
                    self._served(e)[2] += 1
                    self.counts["unreachable"] += 1
                    if attempt >= self.retry_unavailable:
                        raise
                    log.warning("session server: %s lost request %s (%s); re-sending it", e.view.name, rid, exc)
                    continue
                finally:
                    e.inflight.pop(rid, None)
                    self._rid.pop(rid, None)
                served = self._served(e)
                served[0] += 1
                served[1] += len(result.output_ids)
                result.info.setdefault("engine", e.view.name)
                if attempt:
                    result.info["router_retries"] = attempt
                return result
            raise AssertionError("unreachable")
        finally:
            self._aborted.discard(rid)

    async def abort(self, request_id: str) -> bool:
        e = self._rid.get(request_id)
        if e is None:
            self._aborted.add(request_id)  # waiting for an engine: it returns "abort"
            return False
        try:
            return bool(await e.client.abort(request_id))
        except EngineUnavailable:
            return False

    def _served(self, e: _Engine) -> list[int]:
        return self.served.setdefault(e.view.name, [0, 0, 0])

    def end_session(self, session_id: str) -> None:
        self._unpin(session_id)

    async def health(self) -> bool:
        return bool(self.admitted())

    def stats(self) -> dict[str, Any]:
        v = self.view
        return {"serial": v.serial if v else 0, "version": self.weight_version, "held": bool(v and v.held),
                "admitted": self.admitted(),
                "engines": {n: tuple(v) for n, v in self.served.items()},
                "inflight": sum(len(e.inflight) for e in self.engines.values()), **self.counts}

    async def aclose(self) -> None:
        for e in self.engines.values():
            if e.client is not None:
                with contextlib.suppress(Exception):
                    await e.client.aclose()


def _close_later(client: Any) -> None:
    asyncio.ensure_future(client.aclose())
