"""One OpenEnv episode over the server's WebSocket session API (``/ws``).

Each connection is one environment instance on the server. Messages (openenv-core 0.3.0):
``{"type": "reset", "data": {seed, episode_id, ...}}``, ``{"type": "step", "data": <action>}``,
``{"type": "state"}``, ``{"type": "close"}``; replies are ``{"type": "observation", "data":
{"observation", "reward", "done"}}``, ``{"type": "state", "data": {...}}`` or ``{"type": "error",
"data": {"message", "code", ...}}``. The HTTP ``/reset`` and ``/step`` routes build a fresh
environment per request, so a multi-step episode must use this session API.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from miles_env_openenv.server import OpenEnvServerError

# error codes the server sends (openenv.core.env_server.types.WSErrorCode)
ACTION_ERRORS = {"VALIDATION_ERROR", "EXECUTION_ERROR"}  # the episode goes on; the model may retry
CAPACITY_REACHED = "CAPACITY_REACHED"


class OpenEnvActionError(Exception):
    """The server refused one action (invalid against the schema, or the step raised)."""


@dataclass(frozen=True)
class StepReply:
    observation: dict[str, Any]
    reward: float | None
    done: bool


def parse_reply(url: str, payload: Any) -> StepReply:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("observation", {}), dict):
        raise OpenEnvServerError(f"OpenEnv server at {url} sent a malformed observation: {str(payload)[:300]}")
    reward = data.get("reward")
    if reward is not None:  # Observation.reward is bool | int | float | None
        if not isinstance(reward, (bool, int, float)) or not math.isfinite(reward):
            raise OpenEnvServerError(f"OpenEnv server at {url} sent a reward that is not a finite number: {reward!r}")
        reward = float(reward)
    return StepReply(observation=dict(data.get("observation") or {}), reward=reward, done=bool(data.get("done")))


class OpenEnvSession:
    """An open ``/ws`` connection; every failure becomes :class:`OpenEnvServerError` naming the URL,
    except a refused action (:class:`OpenEnvActionError`), after which the session stays usable."""

    def __init__(self, url: str, *, message_timeout_s: float, max_message_bytes: int) -> None:
        self.url = url
        self.message_timeout_s = message_timeout_s
        self.max_message_bytes = max_message_bytes
        self._ws: Any = None

    async def _connect(self, timeout_s: float) -> None:
        from websockets.asyncio.client import connect

        try:
            self._ws = await asyncio.wait_for(
                connect(self.url, max_size=self.max_message_bytes, open_timeout=None, ping_interval=None),
                timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise OpenEnvServerError(
                f"OpenEnv server at {self.url} is unreachable: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
        except Exception as exc:  # handshake refused (HTTP status, bad upgrade)
            raise OpenEnvServerError(f"OpenEnv server at {self.url} refused the WebSocket session: "
                                     f"{type(exc).__name__}: {exc}") from exc

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import WebSocketException

        if self._ws is None:
            raise OpenEnvServerError(f"OpenEnv session at {self.url} is not open")
        try:
            try:
                await self._ws.send(json.dumps(message))
            except WebSocketException:
                # the server may have sent its reason (e.g. CAPACITY_REACHED) and closed before our send:
                # a frame that arrived before the close is still readable
                raw = await asyncio.wait_for(self._ws.recv(), self.message_timeout_s)
            else:
                raw = await asyncio.wait_for(self._ws.recv(), self.message_timeout_s)
        except asyncio.TimeoutError as exc:
            raise OpenEnvServerError(f"OpenEnv server at {self.url} did not answer a '{message['type']}' "
                                     f"within {self.message_timeout_s:g}s") from exc
        except (WebSocketException, OSError) as exc:
            raise OpenEnvServerError(f"OpenEnv server at {self.url} dropped the session during "
                                     f"'{message['type']}': {type(exc).__name__}: {exc}") from exc
        try:
            payload = json.loads(raw)
        except ValueError as exc:
            raise OpenEnvServerError(f"OpenEnv server at {self.url} sent non-JSON: {str(raw)[:300]!r}") from exc
        if not isinstance(payload, dict):
            raise OpenEnvServerError(f"OpenEnv server at {self.url} sent {type(payload).__name__}, not an object")
        return payload

    async def open(self, reset: dict[str, Any], *, connect_timeout_s: float, capacity_wait_s: float) -> StepReply:
        """Connect and reset; while the server is at its session limit, retry until ``capacity_wait_s``."""
        deadline = time.monotonic() + capacity_wait_s
        delay = 0.1
        while True:
            await self._connect(connect_timeout_s)
            payload = await self.request({"type": "reset", "data": reset})
            error = payload.get("data") if payload.get("type") == "error" else None
            if not isinstance(error, dict) or error.get("code") != CAPACITY_REACHED:
                break
            await self.close()
            if time.monotonic() + delay > deadline:
                raise OpenEnvServerError(
                    f"OpenEnv server at {self.url} stayed at its session limit ({error.get('max_sessions')}) for "
                    f"{capacity_wait_s:g}s; run fewer concurrent episodes or raise the server's max_concurrent_envs")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        if payload.get("type") == "error":
            raise OpenEnvServerError(f"OpenEnv server at {self.url} failed to reset: {self._error_text(payload)}")
        return parse_reply(self.url, payload)

    def _error_text(self, payload: dict[str, Any]) -> str:
        data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
        text = f"{data.get('code', 'ERROR')}: {data.get('message', '')}"
        for err in (data.get("errors") or [])[:5]:
            if isinstance(err, dict):
                loc = ".".join(str(p) for p in err.get("loc", ()))
                text += f"; {loc}: {err.get('msg')}" if loc else f"; {err.get('msg')}"
        return text

    async def step(self, action: dict[str, Any]) -> StepReply:
        payload = await self.request({"type": "step", "data": action})
        if payload.get("type") == "error":
            data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
            if data.get("code") in ACTION_ERRORS:
                raise OpenEnvActionError(self._error_text(payload))
            raise OpenEnvServerError(f"OpenEnv server at {self.url} failed a step: {self._error_text(payload)}")
        if payload.get("type") != "observation":
            raise OpenEnvServerError(f"OpenEnv server at {self.url} answered a step with '{payload.get('type')}'")
        return parse_reply(self.url, payload)

    async def state(self) -> dict[str, Any]:
        payload = await self.request({"type": "state"})
        if payload.get("type") != "state" or not isinstance(payload.get("data"), dict):
            raise OpenEnvServerError(f"OpenEnv server at {self.url} answered 'state' with: {str(payload)[:300]}")
        return dict(payload["data"])

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 5.0)
        except Exception:
            pass  # the server may already be gone; closing our side is what matters
        try:
            await asyncio.wait_for(ws.close(), 5.0)
        except Exception:
            pass
