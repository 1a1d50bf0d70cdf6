"""``EmbeddedEngine``: the in-process PyTorch rollout engine (implements ``RolloutEngine``).

    engine = EmbeddedEngine.from_model("tiny:qwen3")            # or a dir, config, .gguf, model
    res = await engine.generate(GenerateRequest(input_ids=[1, 2, 3],
                                                sampling=SamplingParams(temperature=0)))
    await engine.pause("retract"); await engine.update_weights(state); await engine.resume()
    await engine.aclose()

Every method is a coroutine safe to call concurrently from any event loop (each request keeps
the loop that submitted it). Work runs on one engine thread (see ``scheduler``): control
calls (pause, resume, abort, weight updates) take effect between two forward passes.

Semantics worth knowing:
- ``output_logprobs``: log-prob of each sampled token under the distribution it was drawn
  from (after temperature, top-k, top-p and renormalisation); greedy: log-softmax of the raw
  logits. ``weight_versions[i]``: version of the weights whose forward produced token i.
- ``routed_experts`` (MoE only): ``[output_tokens, moe_layers, top_k]``; row i is the routing
  of the forward position whose logits sampled output token i (SGLang's last rows).
  ``info["prompt_routed_experts"]`` holds the rows of the prompt positions before that
  (``prompt_tokens - 1`` rows), so together they are SGLang's full ``seqlen - 1`` rows.
- ``session_id``: prefix reuse, see ``sessions``; ``cached_tokens`` = reused prompt tokens.
- ``update_weights`` while not paused applies between two steps (like ``in_place``).
- ``options.speculative`` (n-gram or draft-model proposals, verified in one forward): the same
  tokens (greedy) or the same distribution (sampled), the policy's log-probs; ``draft.*`` tensors
  in an update go to the draft model. See ``docs/speculative.md``.
- ``info``: ``session_hit``, ``session_hit_rate`` (engine-wide, session requests only),
  ``retractions``, ``latency_s``, ``ttft_s``, ``abort_message``, ``prompt_routed_experts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from pydantic import ValidationError

from miles_engine.engines.embedded import weights as W
from miles_engine.engines.embedded.draft import DraftWeights, load_draft, use_packed_gqa
from miles_engine.engines.embedded.adapter_bases import AdapterBases
from miles_engine.engines.embedded.held_format import HeldFormat
from miles_engine.engines.embedded.kv_codec import FP8KVCodec
from miles_engine.precision.quantizer import kv_fp8
from miles_engine.engines.embedded.options import EmbeddedEngineOptions
from miles_engine.engines.embedded.prompt_scoring import score_prompt
from miles_engine.engines.embedded.runner import ModelRunner
from miles_engine.engines.embedded.sampler import RowParams
from miles_engine.engines.embedded.scheduler import Scheduler
from miles_engine.engines.embedded.speculative import build_decoder
from miles_engine.engines.embedded.updates import WeightUpdates, check_pause_mode
from miles_engine.engines.embedded.sequence import Sequence
from miles_engine.engines.errors import EngineUnavailable
from miles_engine.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    TensorMeta,
)
from miles_engine.errors import ConfigError, EngineRequestError
from miles_engine.models.loading import load_model


def _eos_ids(model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        value = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class EmbeddedEngine(WeightUpdates):
    """In-process rollout engine over any transformers causal LM (CPU or GPU).

    Build it with :meth:`from_model`. The constructor takes a ready model as is (it becomes
    the engine's own: weights change only through :meth:`update_weights`; ``options.dtype`` /
    ``device`` are not applied to it) and starts the engine thread.
    """

    def __init__(self, model: Any, options: EmbeddedEngineOptions | None = None, *,
                 model_path: str | None = None) -> None:
        self.options = options or EmbeddedEngineOptions()
        self.model = model.eval()
        self.model_path = model_path
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        limit = int(getattr(text, "max_position_embeddings", 0) or 0) or 1 << 20
        self.max_context_len = min(self.options.max_context or limit, limit)
        self.eos_token_ids = _eos_ids(model)
        if self.options.true_on_policy:
            from miles_engine import batch_invariant

            try:
                batch_invariant.enable(model)
            except ValueError as exc:
                raise ConfigError(f"engine true_on_policy: {exc}") from None
        elif getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", "batch_invariant"):
            model.set_attn_implementation("sdpa")  # our 4-D ragged masks need sdpa or eager (or batch_invariant)
        if self.options.speculative.enabled and getattr(config, "_attn_implementation", None) == "sdpa":
            use_packed_gqa(model)  # verify forwards are multi-token queries against the cache
        pad = getattr(config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self._kv_quant = kv_fp8 if self.options.kv_cache == "fp8" else None
        self._runner = ModelRunner(model, pad_token_id=pad, kv_codec=FP8KVCodec() if self._kv_quant else None)
        self._held = HeldFormat(model, self.options.weight_format, self.options.weight_exceptions,
                                self.options.weight_storage)
        self._tensors = {**W.model_tensors(model), **self._held.handles}
        self._meta = W.metadata(self._tensors, self._held.formats())
        self._weight_bytes = self._held.nbytes(model)
        self._adapters = AdapterBases()
        self._seeds = itertools.count()
        self._closed = False
        spec = self.options.speculative
        self._draft_runner = (load_draft(spec.draft_model, self._runner, self.vocab_size, self.options.seed)
                              if spec.method == "draft" else None)
        self._draft = DraftWeights(self._draft_runner, method=spec.method, served=spec.train)
        if spec.train:  # the trainer pushes the draft with the policy: its tensors are served names too
            self._meta = self._meta + self._draft.metadata()
        self._speculator = build_decoder(spec, self._draft_runner, self.options.max_prefill_tokens)
        self._sched = Scheduler(
            self._runner, max_batch_size=self.options.max_batch_size,
            max_prefill_tokens=self.options.max_prefill_tokens,
            session_cache_tokens=self.options.session_cache_tokens,
            prompt_cache_tokens=self.options.prompt_cache_tokens,
            num_threads=self.options.num_threads, tensors=self._tensors, speculator=self._speculator)

    @classmethod
    def from_model(cls, source: Any, *, dtype: str = "float32", device: str = "cpu", max_batch_size: int = 64,
                   max_context: int | None = None, num_threads: int | None = 1, seed: int = 0,
                   **options: Any) -> EmbeddedEngine:
        """Build from a model directory, a ``.gguf`` file, a ``config.json`` path, a config
        (dict / ``PretrainedConfig``; random init seeded by ``seed``), a ``tiny:<type>[,k=v]``
        spec, or a model instance (deep-copied). More keys: :class:`EmbeddedEngineOptions`."""
        opts = EmbeddedEngineOptions(dtype=dtype, device=device, max_batch_size=max_batch_size,
                                     max_context=max_context, num_threads=num_threads, seed=seed, **options)
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        model, desc = load_model(source, dtype=opts.dtype, device=opts.device, seed=opts.seed,
                                 attn_implementation=opts.attn_implementation)
        return cls(model, opts, model_path=desc)

    # ------------------------------------------------------------------ introspection
    @property
    def weight_version(self) -> int:
        return self._sched.version

    @property
    def is_moe(self) -> bool:
        return self._runner.capture.is_moe

    @property
    def num_moe_layers(self) -> int | None:
        return self._runner.capture.num_layers if self.is_moe else None

    @property
    def moe_top_k(self) -> int | None:
        return self._runner.capture.top_k if self.is_moe else None

    def weight_metadata(self) -> list[TensorMeta]:
        return list(self._meta)

    def draft_weight_metadata(self) -> list[TensorMeta]:
        """The speculative draft's tensors, named ``draft.<name>`` as an update carries them
        (empty without a draft model): a trainer that co-trains the draft pushes them along."""
        return self._draft.metadata()

    def served_tensors(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The live tensors under the names a push carries: the policy's, and ``draft.*`` when the
        draft is co-trained (what a weight check reads back); only ``names`` when given (a held
        weight is decoded only when asked for)."""
        extra = {**self._draft.served_tensors(), **self._adapters.parts}
        if names is None:
            return {**self.model.state_dict(), **extra}
        found = ((n, extra.get(n, self._tensors.get(n))) for n in names)
        return {n: t.detach() for n, t in found if t is not None}

    def held_parts(self) -> dict[str, torch.Tensor]:
        """Each weight held in a format as the codes and scales the engine holds, under the parts'
        names (``W:q.codes``, ...): what it serves, exactly (re-quantising the decoded values need
        not give the same bytes: NVFP4's tensor scale)."""
        from miles_engine.precision.parts import SEPARATOR

        return {f"{name}{SEPARATOR}{part}": t for name, h in self._held.handles.items()
                for part, t in h.quantized.parts().items()}

    async def keep_lora_base(self, names: list[str]) -> dict[str, str]:
        """Keep the loaded base of each weight in ``names`` for adapter-only pushes (before anything
        overwrites them); their float32 digests (:func:`miles_engine.models.adapters.base_digest`)."""
        return await self._call(lambda: self._adapters.keep(names, self._tensors))

    def stats(self) -> dict[str, Any]:
        """Counters (requests, steps, tokens, mean batch), session-cache hit rates, memory."""
        s = self._sched
        c = dict(s.counters)
        c["mean_batch"] = c["batch_rows"] / c["steps"] if c["steps"] else 0.0
        c.update(s.sessions.stats())
        c.update(s.prompts.stats())
        if self._speculator is not None:
            c.update(self._speculator.counters.stats())
            c["spec_method"] = self.options.speculative.method
            c["spec_draft_updates"] = self._draft.updates
        c.update(running=len(s.running), waiting=len(s.waiting), paused=s.paused, weight_version=s.version,
                 busy_s=s.busy_s, decode_s=s.decode_s, kv_batch_bytes=self._runner.batch.nbytes(),
                 weight_bytes=self._weight_bytes)
        if c["decode_tokens"] and s.decode_s > 0:
            c["decode_tokens_per_s"] = c["decode_tokens"] / s.decode_s
        return c

    async def health(self) -> bool:
        return not self._closed and self._sched.alive and self._sched.error is None

    # ------------------------------------------------------------------ generation
    def _check(self, request: GenerateRequest) -> tuple[SamplingParams, list[int]]:
        sp = request.sampling
        try:
            if isinstance(sp, Mapping):
                sp = SamplingParams.model_validate(dict(sp))
            elif not isinstance(sp, SamplingParams):
                raise EngineRequestError(f"sampling must be SamplingParams or a dict, got {type(sp).__name__}")
            else:
                sp = SamplingParams.model_validate(sp.model_dump())  # catches model_construct bypasses
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "sampling"
            raise EngineRequestError(f"bad sampling params: {where}: {first.get('msg')}") from None
        raw = request.input_ids
        ids = raw.tolist() if hasattr(raw, "tolist") else list(raw)  # tensors / arrays too
        if not ids:
            raise EngineRequestError("input_ids is empty: a prompt needs at least one token")
        plain = all(type(t) is int for t in ids)  # the common case, checked in C
        if not (plain and 0 <= min(ids) and max(ids) < self.vocab_size):
            self._name_bad_id(ids)
        if len(ids) >= self.max_context_len:
            raise EngineRequestError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_context_len} tokens "
                f"(it must leave room for at least one new token)")
        if request.return_routed_experts and not self.is_moe:
            raise EngineRequestError("return_routed_experts was requested but the model is dense (no MoE layers)")
        return sp, ids if plain else [int(t) for t in ids]

    def _name_bad_id(self, ids: list[Any]) -> None:
        """Raise for the first id that is not an in-vocabulary integer (numpy ints are fine)."""
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                try:
                    import numpy as np  # numpy ints are fine
                    ok = isinstance(t, np.integer)
                except ImportError:  # pragma: no cover
                    ok = False
                if not ok:
                    raise EngineRequestError(f"input_ids[{i}] = {t!r} is not an integer token id")
            if not 0 <= int(t) < self.vocab_size:
                raise EngineRequestError(
                    f"input_ids[{i}] = {int(t)} is out of vocabulary (valid ids: 0..{self.vocab_size - 1})")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed or not self._sched.alive:
            raise EngineUnavailable("the embedded engine is closed")
        sp, ids = self._check(request)
        generator = None
        if sp.temperature > 0:
            seed = sp.seed if sp.seed is not None else (self.options.seed * 1_000_003 + next(self._seeds)) % (1 << 62)
            generator = torch.Generator(device=self._runner.device).manual_seed(seed)
        loop = asyncio.get_running_loop()
        seq = Sequence(
            request=request, prompt=ids,
            params=RowParams(float(sp.temperature), float(sp.top_p), int(sp.top_k)),
            generator=generator, stop_ids=frozenset(sp.stop_token_ids) | self.eos_token_ids,
            max_new_tokens=min(sp.max_new_tokens, self.max_context_len - len(ids)),
            loop=loop, future=loop.create_future())
        self._sched.post("add", seq)
        try:
            return await seq.future
        except asyncio.CancelledError:
            with contextlib.suppress(EngineUnavailable):
                self._sched.call_soon(lambda: self._sched.abort(request.request_id), lambda *_: None)
            raise

    async def score_prompt(self, input_ids: list[int], start: int, top_n: int = 0,
                           token_ids: list[int] | None = None) -> Any:
        """SGLang's prefill-only scoring (``max_new_tokens=0``): log-probs of ``input_ids[start+1:]``
        from one teacher-forced forward pass on the engine thread; see
        :class:`~miles_engine.engines.embedded.prompt_scoring.PromptLogprobs`. Never samples."""
        if self._closed or not self._sched.alive:
            raise EngineUnavailable("the embedded engine is closed")
        for what, values in (("input_ids", input_ids), ("token_ids_logprob", token_ids or [])):
            bad = next((i for i, t in enumerate(values) if not 0 <= int(t) < self.vocab_size), None)
            if bad is not None:
                raise EngineRequestError(f"{what}[{bad}] = {int(values[bad])} is out of vocabulary "
                                         f"(valid ids: 0..{self.vocab_size - 1})")
        if len(input_ids) > self.max_context_len:
            raise EngineRequestError(f"input of {len(input_ids)} tokens does not fit the context of "
                                     f"{self.max_context_len} tokens")
        return await self._call(lambda: score_prompt(self.model, input_ids, start, top_n, token_ids, self._kv_quant))

    # ------------------------------------------------------------------ control
    async def _call(self, fn: Any) -> Any:
        if not self._sched.alive:
            raise EngineUnavailable("the embedded engine is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(value: Any, exc: BaseException | None) -> None:
            def _set() -> None:
                if fut.done():
                    return
                fut.set_exception(exc) if exc is not None else fut.set_result(value)
            try:
                loop.call_soon_threadsafe(_set)
            except RuntimeError:
                pass

        self._sched.call_soon(fn, done)
        return await fut

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Stop stepping. ``abort``: in-flight and queued requests finish with ``abort``;
        ``retract``: running requests drop their KV and go back to the queue, to be
        re-prefilled (prompt + tokens so far) after :meth:`resume`; ``in_place``: they keep
        their KV and continue after :meth:`resume`; ``wait``: nothing new is admitted and this
        returns once the running requests have finished. New requests queue while paused."""
        check_pause_mode(mode)
        if mode != "wait":
            await self._call(lambda: self._sched.pause(mode))
            return
        loop = asyncio.get_running_loop()
        drained = loop.create_future()

        def tell() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(lambda: drained.done() or drained.set_result(None))

        await self._call(lambda: self._sched.pause("wait", tell))
        await drained

    async def resume(self) -> None:
        await self._call(self._sched.resume)

    async def abort(self, request_id: str) -> bool:
        """Finish a queued or running request with ``abort`` (partial output kept)."""
        return await self._call(lambda: self._sched.abort(request_id))

    async def aclose(self) -> None:
        """Stop the engine thread; requests still queued or running finish with ``abort``."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(EngineUnavailable):
            self._sched.post("close")
        await asyncio.to_thread(self._sched.thread.join, 30.0)
        self._runner.capture.close()
        if self._draft_runner is not None:
            self._draft_runner.capture.close()
