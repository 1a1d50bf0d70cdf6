"""Talking to a session server as a harness does: create/collect/delete sessions and chat turns.

Chat turns go through the official ``openai`` SDK (``use_openai=True``, the default when it
is installed), or straight over HTTP with ``aiohttp`` (``transport="aiohttp"``, the fast path
for 64+ concurrent episodes) or ``httpx``; ``transport="local"`` hands each request to the
server's ASGI app when the server runs in this process (see :mod:`miles_engine.tito.local`),
else goes over aiohttp. Connection pools are shared per event loop and server: building a
client loads the CA bundle (~30 ms), and httpx's pool checks every idle connection on every
request, which dominated short episodes.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any, Literal

from miles_engine.errors import ConfigError
from miles_engine.tito import local, wire

ENV_URL = "MILES_TITO_URL"
Transport = Literal["httpx", "aiohttp", "local"]
_POOLS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], Any]] = weakref.WeakKeyDictionary()


def server_url(explicit: str | None) -> str:
    url = explicit or os.environ.get(ENV_URL)
    if not url:
        raise ConfigError(f"no session server: set the agent option 'server_url' or ${ENV_URL} "
                          "(start one with `miles serve --family NAME`)")
    return url.rstrip("/")


def _pool(kind: Transport, url: str) -> Any:
    pools = _POOLS.setdefault(asyncio.get_running_loop(), {})
    client = pools.get((kind, url))
    if client is not None and not (client.closed if kind == "aiohttp" else client.is_closed):
        return client
    if kind == "aiohttp":
        try:
            import aiohttp
        except ImportError as exc:
            raise ConfigError("the agent's HTTP transport 'aiohttp' needs the aiohttp package "
                              "(pip install aiohttp)") from exc
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=15))
    else:
        import httpx

        client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
    pools[(kind, url)] = client
    return client


class SessionClient:
    """One session on a TITO server: ``open`` → ``chat``… → ``collect`` → ``close``."""

    def __init__(self, url: str, *, api_key: str = "miles", timeout_s: float = 300.0, use_openai: bool | None = None,
                 model: str = "miles-policy", transport: Transport = "httpx") -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.timeout_s = timeout_s
        self.transport = transport
        self.session_id = ""
        self.base_url = ""
        self._openai: Any = None
        self._use_openai = use_openai

    async def _request(self, method: str, url: str, body: Any = None) -> tuple[int, bytes]:
        headers = {"authorization": f"Bearer {self.api_key}"}
        data = None
        if body is not None:
            data = wire.dumps(body)
            headers["content-type"] = "application/json"
        kind = self.transport
        if kind == "local":
            app = local.app_for(url)
            if app is not None:
                async with asyncio.timeout(self.timeout_s):
                    return await local.request(app, method, url, data, headers)
            kind = "aiohttp"
        client = _pool(kind, self.url)
        if kind == "aiohttp":
            import aiohttp

            async with client.request(method, url, data=data, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                      headers=headers) as resp:
                return resp.status, await resp.read()
        resp = await client.request(method, url, content=data, timeout=self.timeout_s, headers=headers)
        return resp.status_code, resp.content

    async def _json(self, method: str, url: str, body: Any = None) -> Any:
        status, raw = await self._request(method, url, body)
        if status != 200:
            raise RuntimeError(f"{method} {url}: HTTP {status}: {raw[:500].decode(errors='replace')}")
        return wire.loads(raw)

    async def open(self, *, mode: str = "linear", metadata: dict[str, Any] | None = None) -> str:
        body = await self._json("POST", f"{self.url}/sessions", {"mode": mode, "metadata": metadata or {}})
        self.session_id, self.base_url = body["session_id"], body["base_url"]
        if self._use_openai is not False:
            try:
                import openai
            except ImportError:
                if self._use_openai:
                    raise ConfigError("the 'openai' package is not installed (pip install openai)") from None
            else:
                self._openai = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                                                  timeout=self.timeout_s, http_client=_pool("httpx", self.url))
        return self.session_id

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """One chat turn; returns the assistant message as a plain dict (``None`` fields dropped)."""
        params = {k: v for k, v in params.items() if v is not None}
        if self._openai is not None:
            extra = {k: params.pop(k) for k in ("chat_template_kwargs", "top_k") if k in params}
            resp = await self._openai.chat.completions.create(
                model=self.model, messages=messages, extra_body=extra or None, **params)
            return resp.choices[0].message.model_dump(exclude_none=True)
        status, raw = await self._request("POST", f"{self.base_url}/chat/completions",
                                          {"model": self.model, "messages": messages, **params})
        if status != 200:
            raise RuntimeError(f"chat turn failed: HTTP {status}: {raw[:500].decode(errors='replace')}")
        msg = wire.loads(raw)["choices"][0]["message"]
        return {k: v for k, v in msg.items() if v is not None}

    async def collect(self) -> dict[str, Any]:
        return await self._json("GET", f"{self.url}/sessions/{self.session_id}/trajectories")

    async def collect_and_close(self) -> dict[str, Any]:
        """:meth:`collect` and :meth:`close` in one request."""
        report = await self._json("DELETE", f"{self.url}/sessions/{self.session_id}?trajectories=true")
        self.session_id = ""
        return report

    async def close(self, *, delete: bool = True) -> None:
        if delete and self.session_id:
            await self._request("DELETE", f"{self.url}/sessions/{self.session_id}")


async def close_pools() -> None:
    """Close this event loop's pooled HTTP clients (call before the loop ends)."""
    pools = _POOLS.pop(asyncio.get_running_loop(), {})
    for (kind, _url), client in pools.items():
        await (client.close() if kind == "aiohttp" else client.aclose())
