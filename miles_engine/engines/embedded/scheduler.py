"""The engine thread: continuous batching at step granularity.

One dedicated thread owns the model, the running batch and the session cache. Each iteration
it (1) runs the commands queued by the event-loop side (new requests, abort, pause, resume,
weight updates — so they always land *between* two forward passes), then, unless paused,
(2) admits waiting requests up to ``max_batch_size`` — batched prefill, first token sampled,
rows join the running batch — and (3) runs one decode step for every running row (with
``options.speculative``: propose, verify in one forward, keep what exact speculative sampling
accepts; see ``speculative``). A finished request leaves the batch at once and its result goes
back to the caller's loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from miles_engine.engines.embedded import weights as W
from miles_engine.engines.embedded.runner import ModelRunner, PrefillItem
from miles_engine.engines.embedded.sampler import sample
from miles_engine.engines.embedded.sequence import Sequence, resolve
from miles_engine.engines.embedded.sessions import SessionEntry, SessionHit, SessionStore
from miles_engine.engines.embedded.speculative import SpeculativeDecoder
from miles_engine.engines.errors import EngineUnavailable
from miles_engine.engines.protocol import FinishReason, PauseMode

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_batch_size: int, max_prefill_tokens: int,
                 session_cache_tokens: int, num_threads: int | None, tensors: dict[str, torch.Tensor],
                 prompt_cache_tokens: int = 0, speculator: SpeculativeDecoder | None = None) -> None:
        self.runner = runner
        self.speculator = speculator  # None: one token per row and step
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.num_threads = num_threads
        self.tensors = tensors
        self.sessions = SessionStore(session_cache_tokens)
        self.prompts = SessionStore(prompt_cache_tokens, name="prompt")
        self.version = 0
        self.paused = False
        self._drained: list[Callable[[], None]] = []  # pause("wait") callers, told once nothing runs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i].row == i
        self.by_id: dict[str, Sequence] = {}
        self.counters = dict(requests=0, finished=0, aborted=0, steps=0, output_tokens=0, prefill_forwards=0,
                             prefill_tokens=0, batch_rows=0, retracted=0, kept_in_place=0, weight_updates=0,
                             errors=0, decode_tokens=0)
        self.busy_s = 0.0
        self.decode_s = 0.0  # of busy_s: in decode steps (speculative: proposing and verifying)
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._stopped = False  # set (under the lock) once the thread no longer reads the inbox
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="miles-embedded-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ any thread
    def post(self, *cmd: Any) -> None:
        with self._cv:
            if self._stopped:
                raise EngineUnavailable("the embedded engine is closed")
            self._inbox.append(cmd)
            self._cv.notify()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._closing

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            self._run()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._has_work():
                        self._cv.wait()
                    cmds = list(self._inbox)
                    self._inbox.clear()
                for cmd in cmds:
                    self._handle(cmd)
                if self._closing:
                    break
                if self._has_work():
                    t = time.perf_counter()
                    try:
                        self._step()
                    except Exception as exc:  # a failed forward fails its requests, not the engine
                        log.exception("embedded engine step failed")
                        self._fail_running(exc)
                    self.busy_s += time.perf_counter() - t
                if self._drained and not self.running:
                    self._pause_drained()
        except BaseException as exc:  # pragma: no cover - the thread itself died
            self.error = exc
            log.exception("embedded engine thread died")
        finally:
            self._shutdown()

    def _has_work(self) -> bool:
        if self._drained:  # draining for pause("wait"): the running rows only
            return bool(self.running)
        return not self.paused and bool(self.running or self.waiting)

    def _pause_drained(self) -> None:
        self.paused = True
        waiters, self._drained = self._drained, []
        for tell in waiters:
            tell()

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            seq: Sequence = cmd[1]
            self.counters["requests"] += 1
            self.by_id[seq.rid] = seq
            self.waiting.append(seq)
        elif kind == "call":
            fn, done = cmd[1], cmd[2]
            try:
                done(fn(), None)
            except BaseException as exc:
                done(None, exc)
        elif kind == "close":
            self._closing = True

    def _shutdown(self) -> None:
        self._closing = True
        with self._cv:
            self._stopped = True
            cmds = list(self._inbox)
            self._inbox.clear()
        for cmd in cmds:
            if cmd[0] == "add":
                self.by_id[cmd[1].rid] = cmd[1]
                self.waiting.append(cmd[1])
            elif cmd[0] == "call":
                cmd[2](None, EngineUnavailable("the embedded engine is closed"))
        for seq in list(self.running) + list(self.waiting):
            self._finish(seq, "abort", abort_message="engine closed", save=False)
        self.runner.batch.clear()
        self.running.clear()
        waiters, self._drained = self._drained, []
        for tell in waiters:
            tell()

    # ------------------------------------------------------------------ stepping
    def _step(self) -> None:
        if not self._drained:
            self._admit()
        if self.running:
            t = time.perf_counter()
            try:
                self._decode()
            finally:
                self.decode_s += time.perf_counter() - t

    def _admit(self) -> None:
        """Admit waiting requests (FIFO) into the free rows; prefill them in batches of
        similar length, each at most ``max_prefill_tokens`` padded tokens (a longer prompt
        runs alone)."""
        free = self.max_batch_size - len(self.running)
        admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        admitted.sort(key=lambda s: len(s.tokens))
        chunk: list[Sequence] = []
        for seq in admitted:
            if chunk and (len(chunk) + 1) * len(seq.tokens) > self.max_prefill_tokens:
                self._prefill(chunk)
                chunk = []
            chunk.append(seq)
        if chunk:
            self._prefill(chunk)

    def _lookup(self, seq: Sequence) -> SessionHit | None:
        """First admission: the session's cached prefix, else a shared prompt's KV."""
        tokens, hit = seq.tokens, None
        if seq.request.session_id is not None and self.sessions.max_tokens > 0:
            hit = self.sessions.lookup(seq.request.session_id, tokens, self.version)
        seq.session_hit = hit is not None
        if hit is None and self.prompts.max_tokens > 0:
            hit = self.prompts.lookup(tuple(tokens), tokens, self.version)
            seq.prompt_hit = hit is not None
        seq.cached_tokens = hit.length if hit else 0
        return hit

    def _prefill(self, seqs: list[Sequence]) -> None:
        """One batched forward over the new tokens of ``seqs``. Requests of the batch that
        repeat another's whole prompt (the attempts of a GRPO group) share its row: its KV is
        copied to theirs and its last logits sample their first tokens (each with its own
        generator)."""
        items: list[PrefillItem] = []
        which: list[int] = []  # seqs[j] takes the row of items[which[j]]
        first_row: dict[tuple[int, ...], int] = {}
        for seq in seqs:
            tokens, first_admission = seq.tokens, seq.cached_tokens is None
            hit = self._lookup(seq) if first_admission else None
            shareable = first_admission and not seq.session_hit and self.prompts.max_tokens > 0
            key = tuple(tokens) if shareable else None
            if key is not None and key in first_row:
                seq.cached_tokens, seq.prompt_hit = len(tokens), True
                which.append(first_row[key])
                continue
            if key is not None:
                first_row[key] = len(items)
            start = hit.length if hit else 0
            if hit is not None and hit.routing is not None:
                seq.add_routing(hit.routing, 0)
            which.append(len(items))
            items.append(PrefillItem(tokens[start:], start, hit))
        try:
            logits, routing, cache = self.runner.prefill(items)
        except Exception as exc:
            log.exception("embedded engine prefill failed")
            for seq in seqs:
                self._fail(seq, exc)
            return
        self.counters["prefill_forwards"] += 1
        self.counters["prefill_tokens"] += sum(len(it.tokens) for it in items)
        rows = self.runner.batch.add_rows(cache, which)
        to_store = {i for i in first_row.values() if items[i].start == 0}  # new prompts, for later requests
        for seq, row, i in zip(seqs, rows, which):
            seq.row = row
            self.running.append(seq)
            if routing[i] is not None:
                seq.add_routing(routing[i], items[i].start)
            if i in to_store:
                self.prompts.put(tuple(seq.tokens), self._entry(seq))
                to_store.discard(i)
        if len(which) != len(items):
            logits = logits.index_select(0, torch.tensor(which, device=logits.device))
        self._emit(seqs, logits)

    def _decode(self) -> None:
        if self.speculator is not None:
            self._decode_speculative()
            return
        seqs = list(self.running)
        tokens = [s.output[-1] for s in seqs]
        positions = [len(s.prompt) + len(s.output) - 1 for s in seqs]
        logits, routing = self.runner.decode(tokens, positions)
        if routing is not None:
            for i, s in enumerate(seqs):
                s.add_routing(routing[i : i + 1], positions[i])
        self.counters["steps"] += 1
        self.counters["batch_rows"] += len(seqs)
        self.counters["decode_tokens"] += len(seqs)
        self._emit(seqs, logits)

    def _decode_speculative(self) -> None:
        seqs = list(self.running)
        step = self.speculator.step(self.runner, seqs)  # type: ignore[union-attr]
        self.counters["steps"] += 1
        self.counters["batch_rows"] += len(seqs)
        now = time.perf_counter()
        for seq, tokens, logprobs in zip(seqs, step.tokens, step.logprobs):
            self.counters["output_tokens"] += len(tokens)
            self.counters["decode_tokens"] += len(tokens)
            seq.output.extend(tokens)
            seq.logprobs.extend(logprobs)
            seq.versions.extend([self.version] * len(tokens))
            if seq.t_first is None:
                seq.t_first = now
            if tokens[-1] in seq.stop_ids:
                self._finish(seq, "stop")
            elif len(seq.output) >= seq.max_new_tokens:
                self._finish(seq, "length")

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                  invariant=self.runner.invariant)
        now = time.perf_counter()
        self.counters["output_tokens"] += len(seqs)
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.output.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            if seq.t_first is None:
                seq.t_first = now
            if tok in seq.stop_ids:
                self._finish(seq, "stop")
            elif len(seq.output) >= seq.max_new_tokens:
                self._finish(seq, "length")

    # ------------------------------------------------------------------ leaving
    def _release_row(self, seq: Sequence, save: bool) -> None:
        if seq.row is None:
            return
        sid = seq.request.session_id
        if save and sid is not None and not seq.kv_stale and self.sessions.max_tokens > 0:
            self.sessions.put(sid, self._entry(seq))
        r = seq.row
        moved = self.runner.batch.remove_row(r)
        last = self.running.pop()
        if moved is not None:
            last.row = r
            self.running[r] = last
        seq.row = None

    def _entry(self, seq: Sequence) -> SessionEntry:
        """The KV (and routed experts) of every token of ``seq`` that went through the model."""
        keys, values, _ = self.runner.batch.row_tokens(seq.row)
        n = keys[0].shape[1] if keys else 0
        rows = seq.routing_rows()
        routing = rows[:n].clone() if rows is not None and rows.shape[0] >= n else None
        return SessionEntry(seq.tokens, keys, values, routing, self.version)

    def _finish(self, seq: Sequence, reason: FinishReason, *, save: bool = True, **info: Any) -> None:
        if seq.finished:
            return
        self._release_row(seq, save)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.by_id.pop(seq.rid, None)
        self.counters["finished"] += 1
        if reason == "abort":
            self.counters["aborted"] += 1
        if seq.request.session_id is not None:
            look = self.sessions.lookups
            info.setdefault("session_hit_rate", self.sessions.hits / look if look else 0.0)
        resolve(seq, seq.result(reason, **info))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self._release_row(seq, save=False)
        self.by_id.pop(seq.rid, None)
        resolve(seq, error=RuntimeError(f"embedded engine failed on request {seq.rid}: {exc!r}"))

    def _fail_running(self, exc: BaseException) -> None:
        for seq in list(self.running):
            self._fail(seq, exc)
        self.running.clear()
        self.runner.batch.clear()

    # ------------------------------------------------------------------ control (run via "call")
    def pause(self, mode: PauseMode, drained: Callable[[], None] | None = None) -> None:
        """``wait``: the running rows go on decoding, nothing is admitted; ``drained`` is called
        (on this thread) once none runs, and the engine is paused from then on."""
        if mode == "wait":
            if drained is not None:
                self._drained.append(drained)
            if not self.running:
                self._pause_drained()
            return
        self.paused = True
        if mode == "abort":
            for seq in list(self.running) + list(self.waiting):
                self._finish(seq, "abort", abort_message="aborted by pause(mode='abort')")
        elif mode == "retract":
            back = list(self.running)
            for seq in back:
                seq.row = None
                seq.retracted += 1
                seq.kv_stale = False  # re-prefilled on the weights current at resume
            self.running.clear()
            self.runner.batch.clear()
            self.waiting.extendleft(reversed(back))
            self.counters["retracted"] += len(back)
        elif mode == "in_place":
            self.counters["kept_in_place"] += len(self.running)

    def resume(self) -> None:
        self.paused = False
        if self._drained:  # resumed before the drain finished: its waiters are released, nothing paused
            waiters, self._drained = self._drained, []
            for tell in waiters:
                tell()

    def abort(self, request_id: str) -> bool:
        seq = self.by_id.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort", abort_message="aborted by request")
        return True

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int | None) -> int:
        W.apply(tensors, self.tensors)
        self.version = self.version + 1 if version is None else int(version)
        self.sessions.clear()
        self.prompts.clear()
        for seq in self.running:
            seq.kv_stale = True
        self.counters["weight_updates"] += 1
        return self.version

    def call_soon(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        self.post("call", fn, done)
