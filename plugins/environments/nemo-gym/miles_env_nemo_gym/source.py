"""The ``nemo-gym`` environment source: dataset rows as tasks, one resources server for all."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator

import httpx

from miles_engine.environments.capabilities import EnvironmentCapabilities
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import UnknownComponentError, did_you_mean

from miles_env_nemo_gym.options import NemoGymOptions
from miles_env_nemo_gym.rows import Row, load_rows, row_tools
from miles_env_nemo_gym.server import ServerProcess
from miles_env_nemo_gym.task import NemoGymTask

MAX_LISTED_IDS = 10


class NemoGymSource:
    """Tasks from NeMo Gym dataset rows, run against the resources server at ``options.url``
    (or one started from ``options.server``, lazily, at the first episode)."""

    def __init__(self, options: NemoGymOptions) -> None:
        self.options = options
        self.name = options.name
        self.url = options.base_url
        self.rows: list[Row] = load_rows(jsonl=options.jsonl, hf_dataset=options.hf_dataset,
                                         hf_config=options.hf_config, hf_split=options.hf_split,
                                         id_field=options.id_field, limit=options.limit)
        self._by_id = {row.task_id: row for row in self.rows}
        self.server = ServerProcess(options.server, env_name=self.name) if options.server is not None else None
        self._ssl: ssl.SSLContext | None = None

    def list_tasks(self) -> Iterator[TaskRef]:
        for row in self.rows:
            text = next((m["content"] for m in NemoGymTask(self, row).prompt() if m["role"] == "user"), "")
            yield TaskRef(id=row.task_id, description=text[:120])

    def load_task(self, task_id: str) -> NemoGymTask:
        row = self._by_id.get(task_id)
        if row is None:
            ids = list(self._by_id)
            shown = ", ".join(ids[:MAX_LISTED_IDS]) + (", …" if len(ids) > MAX_LISTED_IDS else "")
            raise UnknownComponentError(f"unknown task '{task_id}' in environment '{self.name}'"
                                        f"{did_you_mean(task_id, ids)}; available ({len(ids)}): {shown or 'none'}")
        return NemoGymTask(self, row)

    def capabilities(self) -> EnvironmentCapabilities:
        tools = [t.name for row in self.rows for t in row_tools(row.data["responses_create_params"], row.where)]
        return EnvironmentCapabilities(needs_sandbox=False, multi_turn=self.options.max_turns > 1,
                                       tools=tuple(dict.fromkeys(tools)), services=(self.url,))

    async def ensure_server(self) -> None:
        """Start the configured server command once (no-op when connecting to a URL)."""
        if self.server is not None:
            await asyncio.to_thread(self.server.ensure_started)

    def session_client(self) -> httpx.AsyncClient:
        """A client with its own cookie jar (one per episode); the TLS context is built once and shared."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return httpx.AsyncClient(base_url=self.url, verify=self._ssl, trust_env=False,
                                 timeout=self.options.request_timeout_s)

    def close(self) -> None:
        """Stop the server this source started (idempotent)."""
        if self.server is not None:
            self.server.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return f"NemoGymSource(name={self.name!r}, url={self.url!r}, rows={len(self.rows)})"
