"""Talking to a session server as a harness does: create/collect/delete sessions (httpx) and
chat turns through the official ``openai`` SDK when installed (else plain httpx)."""

from __future__ import annotations

import os
from typing import Any

from miles_engine.errors import ConfigError

ENV_URL = "MILES_TITO_URL"


def server_url(explicit: str | None) -> str:
    url = explicit or os.environ.get(ENV_URL)
    if not url:
        raise ConfigError(f"no session server: set the agent option 'server_url' or ${ENV_URL} "
                          "(start one with `miles serve --family NAME`)")
    return url.rstrip("/")


class SessionClient:
    """One session on a TITO server: ``open`` → ``chat``… → ``collect`` → ``close``."""

    def __init__(self, url: str, *, api_key: str = "miles", timeout_s: float = 300.0, use_openai: bool | None = None,
                 model: str = "miles-policy") -> None:
        import httpx

        self.url = url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)
        self.timeout_s = timeout_s
        self.session_id = ""
        self.base_url = ""
        self._openai: Any = None
        self._use_openai = use_openai

    async def open(self, *, mode: str = "linear", metadata: dict[str, Any] | None = None) -> str:
        resp = await self.http.post("/sessions", json={"mode": mode, "metadata": metadata or {}})
        resp.raise_for_status()
        body = resp.json()
        self.session_id, self.base_url = body["session_id"], body["base_url"]
        if self._use_openai is not False:
            try:
                import openai
            except ImportError:
                if self._use_openai:
                    raise ConfigError("the 'openai' package is not installed (pip install openai)") from None
            else:
                self._openai = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                                  max_retries=0, timeout=self.timeout_s)
        return self.session_id

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """One chat turn; returns the assistant message as a plain dict (``None`` fields dropped)."""
        params = {k: v for k, v in params.items() if v is not None}
        if self._openai is not None:
            extra = {k: params.pop(k) for k in ("chat_template_kwargs", "top_k") if k in params}
            resp = await self._openai.chat.completions.create(
                model=self.model, messages=messages, extra_body=extra or None, **params)
            return resp.choices[0].message.model_dump(exclude_none=True)
        resp = await self.http.post(f"{self.base_url}/chat/completions",
                                    json={"model": self.model, "messages": messages, **params})
        if resp.status_code != 200:
            raise RuntimeError(f"chat turn failed: HTTP {resp.status_code}: {resp.text[:500]}")
        msg = resp.json()["choices"][0]["message"]
        return {k: v for k, v in msg.items() if v is not None}

    async def collect(self) -> dict[str, Any]:
        resp = await self.http.get(f"/sessions/{self.session_id}/trajectories")
        resp.raise_for_status()
        return resp.json()

    async def close(self, *, delete: bool = True) -> None:
        try:
            if delete and self.session_id:
                await self.http.delete(f"/sessions/{self.session_id}")
        finally:
            if self._openai is not None:
                await self._openai.close()
            await self.http.aclose()
