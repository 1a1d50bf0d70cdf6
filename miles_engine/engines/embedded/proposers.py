"""Proposers of speculative decoding: n-gram prompt lookup and a draft model with its own KV cache.

A proposer returns, for every running row, up to ``budget[r]`` proposed tokens and (draft
model) the filtered distribution ``q_j`` each was drawn from; after the policy's verdict,
``rollback`` tells it how many tokens each row emitted, so its own state keeps only what the
sequence now holds.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from miles_engine.engines.embedded.kv_cache import RaggedKV
from miles_engine.engines.embedded.runner import ModelRunner, PrefillItem
from miles_engine.engines.embedded.sequence import Sequence
from miles_engine.engines.embedded.verify import sample_from
from miles_engine.engines.embedded.sampler import filtered_logprobs


class Proposer(Protocol):
    uses_draft_uniforms: bool

    def propose(self, seqs: list[Sequence], budgets: list[int],
                uniforms: list[torch.Tensor | None]) -> tuple[list[list[int]], torch.Tensor | None]: ...

    def rollback(self, seqs: list[Sequence], emitted: list[int]) -> None: ...


def ngram_lookup(tokens: torch.Tensor, n_min: int, n_max: int, limit: int) -> list[int]:
    """What followed the latest earlier occurrence of the last ``n`` tokens (longest ``n`` in
    ``n_max..n_min`` that matches first), at most ``limit`` tokens; [] when nothing matches.
    The reference :class:`NgramIndex` is checked against (and a one-off lookup)."""
    length = tokens.shape[0]
    if limit <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # every earlier n-gram (not the suffix itself)
        hits = (windows == tokens[length - n :]).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : start + limit].tolist()
    return []


class NgramIndex:
    """Incremental :func:`ngram_lookup` for one growing sequence: n-gram -> the position after its
    latest occurrence, over the n-grams that have a next token (so never the suffix itself).
    Each new token adds one entry per n; a lookup is one dict probe per n."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the table

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        length = len(tokens)
        for end in range(max(self.indexed, 1), length):  # n-grams ending at `end` (exclusive), next token exists
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.after[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, length)
        if limit <= 0:
            return []
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.after.get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start : start + limit]
        return []


class NgramProposer:
    """Prompt lookup: the sequence (prompt included) is its own draft. Point-mass proposals."""

    uses_draft_uniforms = False

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[Sequence, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], budgets: list[int],
                uniforms: list[torch.Tensor | None]) -> tuple[list[list[int]], torch.Tensor | None]:
        if len(self.index) > len(seqs):
            live = set(seqs)
            self.index = {s: i for s, i in self.index.items() if s in live}
        out = []
        for seq, budget in zip(seqs, budgets):
            index = self.index.get(seq)
            if index is None:
                index = self.index[seq] = NgramIndex(self.n_min, self.n_max)
            out.append(index.propose(seq.tokens, budget))
        return out, None

    def rollback(self, seqs: list[Sequence], emitted: list[int]) -> None:
        pass


class DraftProposer:
    """A small model on the policy's tokenizer, with its own ragged KV cache (rows keyed by
    sequence, not by the policy's row order). The draft keeps its own weights across policy
    updates, so its cache stays valid then; rows of sequences that left the batch are dropped
    at the next step, and a sequence it has not seen is prefilled whole."""

    uses_draft_uniforms = True

    def __init__(self, runner: ModelRunner, max_prefill_tokens: int) -> None:
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.rows: list[Sequence] = []  # draft row i holds rows[i]
        self.length: dict[Sequence, int] = {}  # tokens of the sequence whose KV the draft holds
        self._decoded = 0  # draft columns written by this step's decode forwards

    @property
    def cache(self) -> RaggedKV:
        return self.runner.batch

    def _drop_gone(self, live: set[Sequence]) -> None:
        for r in range(len(self.rows) - 1, -1, -1):
            seq = self.rows[r]
            if seq in live:
                continue
            self.length.pop(seq, None)
            moved = self.cache.remove_row(r)
            last = self.rows.pop()
            if moved is not None:
                self.rows[r] = last

    def _catch_up(self) -> torch.Tensor | None:
        """Feed every known row the tokens its draft KV lacks (left-padded); last logits [rows, vocab]."""
        if not self.rows:
            return None
        pending = [seq.tokens[self.length[seq]:] for seq in self.rows]
        q = max(len(p) for p in pending)
        n = len(self.rows)
        ids = torch.zeros((n, q), dtype=torch.long)
        pos = torch.zeros((n, q), dtype=torch.long)
        valid = torch.zeros((n, q), dtype=torch.bool)
        for r, (seq, toks) in enumerate(zip(self.rows, pending)):
            s, start = len(toks), self.length[seq]
            ids[r, q - s :] = torch.tensor(toks, dtype=torch.long)
            pos[r, q - s :] = torch.arange(start, start + s)
            valid[r, q - s :] = True
            self.length[seq] = start + s
        logits, _ = self.runner.forward_rows(self.cache, ids, pos, valid, all_logits=False)
        return logits

    def _prefill(self, new: list[Sequence]) -> list[torch.Tensor]:
        out = []
        new = sorted(new, key=lambda s: len(s.tokens))
        chunk: list[Sequence] = []
        for seq in new + [None]:  # type: ignore[list-item]
            if chunk and (seq is None or (len(chunk) + 1) * len(seq.tokens) > self.max_prefill_tokens):
                logits, _, cache = self.runner.prefill([PrefillItem(list(s.tokens), 0, None) for s in chunk])
                self.cache.add_rows(cache)
                for s in chunk:
                    self.rows.append(s)
                    self.length[s] = len(s.tokens)
                out.append(logits)
                chunk = []
            if seq is not None:
                chunk.append(seq)
        return out

    def propose(self, seqs: list[Sequence], budgets: list[int],
                uniforms: list[torch.Tensor | None]) -> tuple[list[list[int]], torch.Tensor | None]:
        self._decoded = 0
        self._drop_gone(set(seqs))
        steps = max(budgets, default=0)
        if steps <= 0:
            return [[] for _ in seqs], None
        known = self._catch_up()
        new = [s for s in seqs if s not in self.length]
        parts = ([known] if known is not None else []) + self._prefill(new)
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]  # draft row order
        row_of = {seq: r for r, seq in enumerate(self.rows)}
        order = torch.tensor([row_of[s] for s in seqs], device=logits.device)
        params = [s.params for s in self.rows]
        inverse = _positions(seqs, self.rows)
        hot = [i for i, s in enumerate(self.rows) if s.params.temperature > 0.0]
        hot_u = [uniforms[inverse[i]] for i in hot]
        logq_steps: list[torch.Tensor] = []
        token_steps: list[torch.Tensor] = []
        for j in range(steps):
            logq = filtered_logprobs(logits, params, invariant=False)
            tokens = logits.argmax(-1)
            if hot:
                h = torch.tensor(hot, device=logits.device)
                u = torch.stack([t[j] for t in hot_u])  # type: ignore[index]
                tokens[h] = sample_from(logq[h], u)
            logq_steps.append(logq)
            token_steps.append(tokens)
            if j + 1 < steps:
                positions = torch.tensor([self.length[s] + j for s in self.rows])
                ones = torch.ones((len(self.rows), 1), dtype=torch.bool)
                logits, _ = self.runner.forward_rows(self.cache, tokens[:, None].cpu(), positions[:, None], ones,
                                                     all_logits=False)
                self._decoded += 1
        drafted = torch.stack(token_steps, 1).index_select(0, order)  # [seqs, steps]
        logq_all = torch.stack(logq_steps, 1).index_select(0, order)  # [seqs, steps, vocab]
        lists = drafted.tolist()
        return [lists[i][: max(b, 0)] for i, b in enumerate(budgets)], logq_all

    def reset(self) -> None:
        """Forget every row (after a draft weight update: its KV came from the old draft)."""
        self.cache.clear()
        self.rows.clear()
        self.length.clear()
        self._decoded = 0

    def rollback(self, seqs: list[Sequence], emitted: list[int]) -> None:
        """Keep the draft KV of proposals the policy kept (those are now sequence tokens)."""
        if self._decoded == 0:
            return
        by_seq = dict(zip(seqs, emitted))
        keep = [min(by_seq.get(s, 1) - 1, self._decoded) for s in self.rows]
        self.cache.keep_new(keep, self._decoded)
        for s, kept in zip(self.rows, keep):
            self.length[s] += kept
        self._decoded = 0


def _positions(seqs: Seq[Sequence], rows: Seq[Sequence]) -> list[int]:
    where = {s: i for i, s in enumerate(seqs)}
    return [where[s] for s in rows]
