"""The session manager: sessions by id, and the chat pipeline plan → generate → commit.

Collection is decided here, never by the client: every generation asks the engine for
log-probs and weight versions, and for routed experts when ``record_routed_experts`` is on.
A failed, aborted or malformed generation commits nothing.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.engines.protocol import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from miles_engine.tito.api import ChatRequest, Completion, parse_chat_request, wire_message
from miles_engine.tito.diagnostic import summarize_by_wire
from miles_engine.tito.errors import (
    BadRequest,
    Conflict,
    EngineFailed,
    GenerationAborted,
    SessionNotFound,
    TooManySessions,
)
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.matchers import resolve_matcher
from miles_engine.tito.session import Session
from miles_engine.tito.stops import apply_stop_strings
from miles_engine.tito.trajectory import session_report


class SessionServerConfig(Section):
    """Options of the session server (``extra="forbid"``)."""

    model_name: str = Field("miles-policy", description="the model id shown to clients")
    mode: Literal["linear", "branching"] = Field("linear", description="default session mode")
    matcher: str = Field("strict", description="strict | loose_tool_call | role_content_only | dotted path")
    max_sessions: int = Field(100_000, ge=1)
    max_nodes: int = Field(1024, ge=1, description="generations per branching session")
    default_max_tokens: int = Field(1024, ge=1)
    max_tokens_limit: int | None = Field(None, ge=1, description="cap on a request's max_tokens")
    max_prompt_tokens: int | None = Field(None, ge=1, description="longest prompt (token row) a turn may send "
                                          "to the engine; longer: 400 naming 'messages'")
    max_request_bytes: int = Field(64 << 20, ge=1024, description="largest request body; larger: 413")
    record_routed_experts: bool = False
    drop_retries: bool = Field(True, description="branching: drop leaves whose generation was retried")
    diagnose_every: int = Field(
        1, ge=0, description="re-render and re-tokenize the trajectories of every Nth session to report "
        "tito_session_mismatch (1: all, 0: none; a session may ask with \"diagnose\": true). The re-render "
        "is most of a short episode's server time, and the rates are estimated as well from a sample")
    otel: bool = Field(False, description="FastAPI's native OpenTelemetry instrumentation of the server's "
                       "requests (when a provider is configured); off: its per-request provider lookup "
                       "cost ~4 % of the recipe driver's CPU")


class RunSessionServerConfig(SessionServerConfig):
    """The run's session server: the manager's options plus where it listens, so a harness in another
    process or sandbox can drive the run's sessions (its URL is written to RUN_DIR/session_server.url)."""

    host: str = Field("127.0.0.1", description="address the run's session server binds (loopback by default; a "
                      "harness in a container needs an address it can reach)")
    port: int = Field(0, ge=0, le=65535, description="its port (0: any free port)")


class SessionManager:
    def __init__(self, engine: RolloutEngine, codec: ChatCodec, config: SessionServerConfig | None = None) -> None:
        self.engine = engine
        self.codec = codec
        self.config = config or SessionServerConfig()
        self.default_matcher = resolve_matcher(self.config.matcher)
        self.sessions: dict[str, Session] = {}
        self._deleted: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._reports: collections.deque[tuple[str | None, dict[str, Any]]] = collections.deque(maxlen=10_000)
        self.overheads: collections.deque[float] = collections.deque(maxlen=100_000)
        self.counters: collections.Counter[str] = collections.Counter()

    # ---- sessions ------------------------------------------------------------------------------
    def create(self, body: dict[str, Any] | None = None) -> Session:
        body = body or {}
        if not isinstance(body, dict):
            raise BadRequest("the body of POST /sessions must be a JSON object or empty")
        unknown = set(body) - {"mode", "matcher", "metadata", "drop_retries", "diagnose"}
        if unknown:
            raise BadRequest(f"unknown session field(s) {sorted(unknown)}; "
                             "accepted: mode, matcher, metadata, drop_retries, diagnose")
        diagnose = body.get("diagnose")
        if diagnose is not None and not isinstance(diagnose, bool):
            raise BadRequest(f"diagnose must be true or false, got {diagnose!r}", param="diagnose")
        mode = body.get("mode", self.config.mode)
        if mode not in ("linear", "branching"):
            raise BadRequest(f"mode must be 'linear' or 'branching', got {mode!r}", param="mode")
        matcher = self.default_matcher
        if body.get("matcher") is not None:
            try:
                matcher = resolve_matcher(str(body["matcher"]))
            except Exception as exc:
                raise BadRequest(str(exc), param="matcher") from None
        if len(self.sessions) >= self.config.max_sessions:
            raise TooManySessions(f"the server holds {self.config.max_sessions} sessions; delete finished ones")
        sid = secrets.token_urlsafe(24)  # 192 random bits
        every = self.config.diagnose_every
        if diagnose is None:
            diagnose = bool(every) and self.counters["sessions_created"] % every == 0
        session = Session(sid, self.codec, matcher, mode=mode, max_nodes=self.config.max_nodes,
                          drop_retries=bool(body.get("drop_retries", self.config.drop_retries)),
                          metadata=body.get("metadata") if isinstance(body.get("metadata"), dict) else None,
                          diagnose=diagnose)
        self.sessions[sid] = session
        self.counters["sessions_created"] += 1
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._deleted:
                raise SessionNotFound(f"session '{session_id}' was deleted")
            raise SessionNotFound(f"unknown session '{session_id}'; create one with POST /sessions")
        return session

    async def delete(self, session_id: str) -> dict[str, Any]:
        session = self.get(session_id)
        session.closed = True
        del self.sessions[session_id]
        self._deleted[session_id] = time.time()
        while len(self._deleted) > 100_000:
            self._deleted.popitem(last=False)
        for rid in list(session.inflight):
            try:
                await self.engine.abort(rid)
            except Exception:  # the generation is discarded either way
                pass
        end = getattr(self.engine, "end_session", None)
        if end is not None:  # a router: the session no longer pins its engine
            end(session_id)
        return {"session_id": session_id, "deleted": True}

    def trajectories(self, session_id: str) -> dict[str, Any]:
        report = session_report(self.get(session_id))
        for t in report["trajectories"]:
            if "tito_session_mismatch" in t:
                self._reports.append((t["wire"], t["tito_session_mismatch"]))
        return report

    def metrics(self) -> dict[str, Any]:
        over = sorted(self.overheads)

        def pct(q: float) -> float | None:
            return over[min(len(over) - 1, int(q * len(over)))] if over else None

        return {"sessions": len(self.sessions), **self.counters,
                "server_overhead_s/p50": pct(0.5), "server_overhead_s/p99": pct(0.99),
                **summarize_by_wire(list(self._reports))}

    # ---- chat ----------------------------------------------------------------------------------
    async def chat(self, session_id: str, body: Any) -> tuple[Completion, ChatRequest]:
        """One OpenAI chat-completions turn."""
        def parse(session: Session) -> ChatRequest:
            req = parse_chat_request(body, self.codec.family, session.parse_cache)
            session.parse_cache = list(zip(body["messages"], req.messages))
            return req

        turn, req = await self.serve(session_id, parse, wire="chat")
        return turn.completion(self.config.model_name, self.codec.family.has_reasoning), req

    async def serve(self, session_id: str, parse: Callable[[Session], ChatRequest],
                    on_commit: Callable[[Session, ChatRequest, Turn], None] | None = None, *,
                    wire: str = "chat") -> tuple[Turn, ChatRequest]:
        """One turn of any wire format: ``parse`` validates the request into normalised messages
        (and may use the session's caches), then plan → generate → commit. ``on_commit`` runs
        right after the commit (a wire format's own bookkeeping, e.g. Responses ids). ``wire``
        (chat | messages | responses) names the route in the turn counters and the session's
        report, so mismatch rates are also given per wire format."""
        t0 = time.perf_counter()
        session = self.get(session_id)
        req = parse(session)
        if session.mode == "linear":
            if session.busy:
                raise Conflict(f"session '{session_id}' is already generating; a linear session takes one "
                               "request at a time", code="session_busy")
            session.busy = True
        try:
            kwargs = self.codec.kwargs(req.kwargs)
            plan = session.plan(req.messages, req.tools, req.tools_key, kwargs)
            self._check_prompt_size(plan.input_ids)
            gen = GenerateRequest(input_ids=plan.input_ids, sampling=self._sampling(req), session_id=session_id,
                                  return_logprob=True, return_routed_experts=self.config.record_routed_experts)
            t1 = time.perf_counter()
            result = await self._generate(session, gen)
            t2 = time.perf_counter()
            turn = self._finish(session, req, plan, result, kwargs)
            session.wires[wire] += 1
            self.counters[f"turns/{wire}"] += 1
            if on_commit is not None:
                on_commit(session, req, turn)
            self.overheads.append((t1 - t0) + (time.perf_counter() - t2))
            return turn, req
        finally:
            if session.mode == "linear":
                session.busy = False

    def _check_prompt_size(self, input_ids: list[int]) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and len(input_ids) > limit:
            raise BadRequest(f"the prompt is {len(input_ids)} tokens, over this server's max_prompt_tokens "
                             f"{limit}: shorten the conversation", param="messages", code="prompt_too_long")

    def count_prompt(self, session_id: str, req: ChatRequest) -> int:
        """Tokens the request's prompt would have (the stored row it extends plus the appended
        ids, else a full render), without generating or changing the session."""
        session = self.get(session_id)
        kwargs = self.codec.kwargs(req.kwargs)
        try:
            return len(session.plan(req.messages, req.tools, req.tools_key, kwargs).input_ids)
        except Conflict:
            return len(self.codec.encode_conversation(req.messages, req.tools, add_generation_prompt=True,
                                                      kwargs=kwargs))

    def _sampling(self, req: ChatRequest) -> SamplingParams:
        limit = self.config.max_tokens_limit
        max_tokens = req.max_tokens or min(self.config.default_max_tokens, limit or self.config.default_max_tokens)
        if limit is not None and max_tokens > limit:
            raise BadRequest(f"max_tokens {max_tokens} exceeds this server's limit {limit}",
                             param="max_tokens")
        stop_ids = list(self.codec.stop_ids)
        for s in req.stop:  # a stop string that is one added token stops the engine directly
            idx = self.codec.tokenizer.added_tokens.get(s)
            if idx is not None and idx not in stop_ids:
                stop_ids.append(idx)
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids), seed=req.seed)

    async def _generate(self, session: Session, gen: GenerateRequest) -> GenerateResult:
        session.inflight.add(gen.request_id)
        try:
            result = await self.engine.generate(gen)
        except asyncio.CancelledError:
            raise
        except ValueError as exc:  # the engine refused the request (e.g. the row exceeds its context)
            self.counters["engine_refused"] += 1
            raise BadRequest(f"the rollout engine refused the request: {exc}") from exc
        except Exception as exc:
            self.counters["engine_errors"] += 1
            if _unavailable(exc):
                raise GenerationAborted(f"the rollout engine is unavailable: {exc}; nothing was recorded, "
                                        "retry the request") from exc
            raise EngineFailed(f"the rollout engine failed: {type(exc).__name__}: {exc}") from exc
        finally:
            session.inflight.discard(gen.request_id)
        if session.closed:
            raise SessionNotFound(f"session '{session.id}' was deleted while the request was generating")
        if result.finish_reason == "abort":
            self.counters["aborted"] += 1
            raise GenerationAborted("the generation was aborted (engine paused or updating weights); "
                                    "nothing was recorded, retry the request")
        n = len(result.output_ids)
        if len(result.output_logprobs) != n or len(result.weight_versions) != n or (
                result.routed_experts is not None and len(result.routed_experts) != n):
            raise EngineFailed(f"the engine returned {n} ids but {len(result.output_logprobs)} log-probs and "
                               f"{len(result.weight_versions)} versions; nothing was recorded")
        return result

    def _finish(self, session: Session, req: ChatRequest, plan: Any, result: GenerateResult,
                kwargs: dict[str, Any]) -> Turn:
        codec = self.codec
        cut = apply_stop_strings(codec, result.output_ids, req.stop)
        n = cut.keep
        output_ids = list(result.output_ids[:n])
        routed = result.routed_experts[:n] if result.routed_experts is not None else None
        if cut.text is not None:
            parsed = codec.family.parse(cut.text, kwargs=kwargs, tools=req.tools,
                                        parse_tools=req.parse_tools and bool(req.tools))
        else:
            parsed = codec.parse_output(output_ids, kwargs=kwargs, tools=req.tools, parse_tools=req.parse_tools)
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": c.name,
                  "arguments": json.dumps(c.arguments, ensure_ascii=False)} for c in parsed.calls]
        assistant = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning,
                     "tool_calls": calls}
        if calls:
            finish = "tool_calls"
        elif cut.text is not None:
            finish = "stop"
        else:
            finish = "length" if result.finish_reason == "length" else "stop"
        session.commit(plan, assistant=assistant, output_ids=output_ids, logprobs=result.output_logprobs[:n],
                       versions=result.weight_versions[:n], routed_experts=routed,
                       finish_reason=result.finish_reason if cut.text is None else "stop")
        self.counters["turns"] += 1
        logprobs = None
        if req.logprobs:
            content_ids = codec.strip_stop(output_ids)
            logprobs = [{"token": codec.tokenizer.piece(t), "logprob": lp,
                         "bytes": list(codec.tokenizer.piece(t).encode()), "top_logprobs": []}
                        for t, lp in zip(content_ids, result.output_logprobs)]
        return Turn(assistant=assistant, finish_reason=finish, prompt_tokens=len(plan.input_ids),
                    completion_tokens=n, cached_tokens=len(plan.input_ids) - len(plan.env_ids), logprobs=logprobs,
                    stop_sequence=cut.stop)


@dataclass
class Turn:
    """One committed generation, wire-format neutral: the normalised assistant message and the
    token counts every API reports (``completion_tokens``: the sampled ids kept in the row)."""

    assistant: dict[str, Any]
    finish_reason: str  # "tool_calls" | "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    stop_sequence: str | None = None  # the client stop string that ended the turn

    def completion(self, model: str, with_reasoning: bool) -> Completion:
        return Completion(
            id=f"chatcmpl-{uuid.uuid4().hex}", model=model,
            message=wire_message(self.assistant, with_reasoning=with_reasoning),
            finish_reason=self.finish_reason, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens, logprobs=self.logprobs,
        )


def _unavailable(exc: Exception) -> bool:
    try:
        from miles_engine.engines.errors import EngineUnavailable
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, EngineUnavailable)
