"""A small, faithful fake of the RolloutEngine protocol (deterministic tokens, real pause /
abort / weight-update semantics, validation of bad input) for server, router and supervisor
tests. ``make_fake_engine`` is also an ``--engine-factory`` for subprocess servers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_engine.engines.protocol import GenerateRequest, GenerateResult, PauseMode, TensorMeta


class FakeEngine:
    def __init__(self, *, vocab_size: int = 64, max_context_len: int = 256, moe: bool = False,
                 step_delay: float = 0.0, name: str = "fake") -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.is_moe = moe
        self.moe_top_k = 2 if moe else None
        self.num_moe_layers = 3 if moe else None
        self.step_delay = step_delay
        self.model_path = f"fake://{name}"
        import torch  # lazily: a crash-loop test's failing factory must stay cheap

        self._weights = {"embed.weight": torch.zeros(vocab_size, 4), "head.bias": torch.zeros(vocab_size)}
        self._version = 0
        self._gate = asyncio.Event()
        self._gate.set()
        self._aborted: set[str] = set()
        self.inflight: dict[str, GenerateRequest] = {}
        self.healthy = True
        self.closed = False
        self.calls: list[GenerateRequest] = []
        self.pauses: list[str] = []

    @property
    def weight_version(self) -> int:
        return self._version

    def _check(self, req: GenerateRequest) -> None:
        ids = list(req.input_ids)
        if not ids:
            raise ValueError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        if len(ids) >= self.max_context_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context ({self.max_context_len})")
        if req.return_routed_experts and not self.is_moe:
            raise ValueError("routed experts requested from a dense model")

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self._check(req)
        if self.closed:
            raise RuntimeError("engine closed")
        self.calls.append(req)
        self.inflight[req.request_id] = req
        out: list[int] = []
        versions: list[int] = []
        finish = "length"
        last = req.input_ids[-1]
        seed = req.sampling.seed or 0
        try:
            for _ in range(min(req.sampling.max_new_tokens, self.max_context_len - len(req.input_ids))):
                await self._gate.wait()
                if req.request_id in self._aborted:
                    finish = "abort"
                    break
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                if req.request_id in self._aborted:
                    finish = "abort"
                    break
                last = (last * 7 + 3 + seed) % self.vocab_size
                out.append(last)
                versions.append(self._version)
                if last in req.sampling.stop_token_ids:
                    finish = "stop"
                    break
        finally:
            self.inflight.pop(req.request_id, None)
            self._aborted.discard(req.request_id)
        routed = [[[(t + l) % 8, (t + l + 1) % 8] for l in range(3)] for t in out] if req.return_routed_experts else None
        return GenerateResult(
            request_id=req.request_id, output_ids=out, output_logprobs=[-0.01 - 0.1 * (t % 5) for t in out],
            weight_versions=versions, finish_reason=finish, prompt_tokens=len(req.input_ids),  # type: ignore[arg-type]
            routed_experts=routed,
        )

    async def pause(self, mode: PauseMode = "retract") -> None:
        self.pauses.append(mode)
        self._gate.clear()
        if mode == "abort":
            self._aborted.update(self.inflight)
            self._gate.set()  # let aborted requests return; new steps stay blocked below
            await asyncio.sleep(0)
            self._gate.clear()

    async def resume(self) -> None:
        self._gate.set()

    async def abort(self, request_id: str) -> bool:
        if request_id in self.inflight:
            self._aborted.add(request_id)
            return True
        return False

    async def update_weights(self, weights: Mapping[str, Any] | Path, *, version: int | None = None) -> int:
        if isinstance(weights, (str, Path)):
            from safetensors.torch import load_file

            files = sorted(Path(weights).glob("*.safetensors"))
            if not files:
                raise ValueError(f"no *.safetensors files in {weights}")
            loaded: dict[str, Any] = {}
            for f in files:
                loaded.update(load_file(str(f)))
            weights = loaded
        for name, t in weights.items():
            if name not in self._weights:
                raise ValueError(f"unknown tensor {name!r}")
            ref = self._weights[name]
            if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
                raise ValueError(f"tensor {name!r}: got {t.dtype} {tuple(t.shape)}, model has {ref.dtype} {tuple(ref.shape)}")
        for name, t in weights.items():
            self._weights[name] = t.clone()
        self._version = self._version + 1 if version is None else version
        return self._version

    def weight_metadata(self) -> list[TensorMeta]:
        return [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in self._weights.items()]

    def weights(self) -> dict[str, Any]:
        return dict(self._weights)

    async def health(self) -> bool:
        return self.healthy and not self.closed

    async def aclose(self) -> None:
        self.closed = True


def make_fake_engine(model: str, *, dtype: str | None = None, threads: int | None = None) -> FakeEngine:
    """``--engine-factory tests.engines.fakes:make_fake_engine --model fake:delay=0.01,moe=1``
    (``failfile=PATH``: refuse to start while PATH exists, for crash-loop tests)."""
    opts: dict[str, Any] = {}
    spec = model.removeprefix("fake:") if model.startswith("fake:") else ""
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        opts[key] = value
    if opts.get("failfile") and Path(opts["failfile"]).exists():
        raise RuntimeError(f"fake engine refuses to start: {opts['failfile']} exists")
    return FakeEngine(vocab_size=int(opts.get("vocab", 64)), step_delay=float(opts.get("delay", 0.0)),
                      moe=opts.get("moe", "0") == "1", name=opts.get("name", "fake"))
