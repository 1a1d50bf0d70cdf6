"""One NeMo Gym row as a task: ``/seed_session``, tool calls routed to ``POST /{tool}``, ``/verify``.

Each episode has its own HTTP client, hence its own cookie jar: NeMo Gym keeps per-rollout
state in a session cookie set by ``/seed_session``, so every later call of the episode (tools,
verify) must carry that episode's cookies and no other episode's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from miles_engine.environments.protocol import (
    EpisodeContext,
    Message,
    NoReferenceSolution,
    RewardResult,
    TaskLimits,
    ToolResult,
    ToolSpec,
)
from miles_engine.errors import MilesError

from miles_env_nemo_gym.responses import parse_verify_reply, response_object
from miles_env_nemo_gym.rows import Row, prompt_messages, row_tools

if TYPE_CHECKING:
    from miles_env_nemo_gym.source import NemoGymSource

CLIENT_KEY = "nemo_gym_client"


class ResourcesServerCallError(MilesError):
    """A call to the resources server failed (unreachable, refused, or an error status)."""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class NemoGymTask:
    """A dataset row run against a NeMo Gym resources server."""

    def __init__(self, source: NemoGymSource, row: Row) -> None:
        self.source = source
        self.row = row
        self.id = row.task_id
        params = row.data["responses_create_params"]
        self._prompt = prompt_messages(params, row.where)
        self._tools = row_tools(params, row.where)
        o = source.options
        self.limits = TaskLimits(agent_timeout_s=o.agent_timeout_s, verifier_timeout_s=o.verify_timeout_s,
                                 max_turns=o.max_turns)
        self.metadata: dict[str, Any] = {"source": source.name, "row": row.where, "server": source.url}

    @property
    def url(self) -> str:
        return self.source.url

    def prompt(self) -> list[Message]:
        return [dict(m) for m in self._prompt]

    def sandbox_spec(self) -> None:
        return None

    def tools(self) -> list[ToolSpec]:
        return list(self._tools)

    def _client(self, ctx: EpisodeContext) -> httpx.AsyncClient:
        client = ctx.info.get(CLIENT_KEY)
        if client is None:
            raise ResourcesServerCallError(f"task '{self.id}': no session with {self.url} (setup did not run)")
        return client

    async def _post(self, client: httpx.AsyncClient, route: str, payload: Any, timeout_s: float) -> httpx.Response:
        try:
            return await client.post(route, json=payload, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ResourcesServerCallError(
                f"NeMo Gym resources server at {self.url}{route} is unreachable: {_describe(exc)}") from exc

    async def setup(self, ctx: EpisodeContext) -> None:
        await self.source.ensure_server()
        client = self.source.session_client()
        ctx.info[CLIENT_KEY] = client
        answer = await self._post(client, "/seed_session", self.row.data, self.source.options.request_timeout_s)
        if not answer.is_success:
            raise ResourcesServerCallError(f"NeMo Gym seed_session at {self.url}/seed_session answered HTTP "
                                           f"{answer.status_code}: {answer.text[:200]!r}")

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name not in {t.name for t in self._tools}:
            known = ", ".join(t.name for t in self._tools) or "none"
            return ToolResult(f"error: unknown tool '{name}'; available tools: {known}", is_error=True)
        try:
            answer = await self._post(self._client(ctx), f"/{name}", arguments, self.source.options.request_timeout_s)
        except ResourcesServerCallError as exc:
            ctx.info.setdefault("nemo_gym_errors", []).append(str(exc))
            return ToolResult(f"error: {exc}", is_error=True)
        # like NeMo Gym's agents: an error status is a valid tool answer (e.g. bad arguments), passed on as is
        return ToolResult(answer.text, is_error=not answer.is_success)

    async def solve(self, ctx: EpisodeContext) -> None:
        raise NoReferenceSolution(f"task '{self.id}': NeMo Gym rows carry no reference solution")

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        params = self.row.data["responses_create_params"]
        body = {**self.row.data, "response": response_object(ctx.transcript, params, self.source.options.model)}
        try:
            answer = await self._post(self._client(ctx), "/verify", body, self.source.options.verify_timeout_s)
        except ResourcesServerCallError as exc:
            return RewardResult.failed(str(exc))
        result = parse_verify_reply(f"{self.url}/verify", answer.status_code, answer.text)
        errors = ctx.info.get("nemo_gym_errors")
        if errors:
            result.info["tool_errors"] = list(errors)
        return result

    async def teardown(self, ctx: EpisodeContext) -> None:
        client = ctx.info.pop(CLIENT_KEY, None)
        if client is not None:
            await client.aclose()

    def __repr__(self) -> str:
        return f"NemoGymTask(id={self.id!r}, url={self.url!r})"
