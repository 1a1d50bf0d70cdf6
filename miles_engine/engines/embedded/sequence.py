"""State of one request inside the engine thread, and how it is handed back to its caller."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_engine.engines.embedded.sampler import RowParams
from miles_engine.engines.protocol import FinishReason, GenerateRequest, GenerateResult


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    prompt: list[int]
    params: RowParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    max_new_tokens: int  # already clamped to the context
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # routed experts of every position fed through the model, in order: [n, layers, top_k] chunks
    routing: list[torch.Tensor] = field(default_factory=list)
    routed_positions: int = 0
    row: int | None = None  # row in the running batch, None while waiting
    kv_stale: bool = False  # KV partly from older weights (in_place update): never cached
    cached_tokens: int | None = None  # prefix reused at first admission
    session_hit: bool = False
    prompt_hit: bool = False  # the shared-prompt cache served the prefix
    retracted: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    finished: bool = False

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def add_routing(self, rows: torch.Tensor, first_position: int) -> None:
        """Record routing for positions ``first_position..``; positions already recorded keep
        the routing that produced them (e.g. across a retract re-prefill)."""
        skip = self.routed_positions - first_position
        if skip < rows.shape[0]:
            new = rows[max(skip, 0):]
            self.routing.append(new)
            self.routed_positions += new.shape[0]

    def routing_rows(self) -> torch.Tensor | None:
        if not self.routing:
            return None
        if len(self.routing) > 1:
            self.routing = [torch.cat(self.routing)]
        return self.routing[0]

    def result(self, reason: FinishReason, **info: Any) -> GenerateResult:
        req = self.request
        routed = None
        extra: dict[str, Any] = {}
        if req.return_routed_experts:
            rows = self.routing_rows()
            p = len(self.prompt)
            if rows is not None and self.output:
                routed = rows[p - 1 : p - 1 + len(self.output)].tolist()
                extra["prompt_routed_experts"] = rows[: p - 1].tolist()
            else:
                routed = []
        now = time.perf_counter()
        return GenerateResult(
            request_id=req.request_id,
            output_ids=list(self.output),
            output_logprobs=list(self.logprobs) if req.return_logprob else [],
            weight_versions=list(self.versions),
            finish_reason=reason,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens or 0,
            routed_experts=routed,
            info={
                "session_hit": self.session_hit,
                "prompt_hit": self.prompt_hit,
                "retractions": self.retracted,
                "latency_s": now - self.t_submit,
                "ttft_s": (self.t_first - self.t_submit) if self.t_first is not None else None,
                **extra,
                **info,
            },
        )


def resolve(seq: Sequence, result: GenerateResult | None = None, error: BaseException | None = None) -> None:
    """Hand a result (or an error) back to the caller's event loop, from any thread."""
    seq.finished = True

    def _set() -> None:
        if seq.future.done():
            return
        if error is not None:
            seq.future.set_exception(error)
        else:
            seq.future.set_result(result)

    try:
        seq.loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass
