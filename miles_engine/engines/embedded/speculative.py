"""Speculative decoding step of the embedded engine: propose, verify in one forward, roll back.

Replaces the plain decode step (one token per row) when ``options.speculative`` is on. Every
running row feeds its last token and its proposals (right-padded to the longest row) through
the policy in one forward; :func:`~miles_engine.engines.embedded.verify.verify` decides what
is kept (exact speculative sampling); the policy's KV of the rejected positions — and the
draft's — is dropped (those columns become holes that later forwards never attend, compacted
away once they pile up). A row never proposes past ``max_new_tokens`` (the policy's own token
after the proposals included) and stops at the first stop id among the emitted tokens, so what
it returns is always what plain decoding could have returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miles_engine.engines.embedded.options import SpeculativeOptions
from miles_engine.engines.embedded.proposers import DraftProposer, NgramProposer, Proposer
from miles_engine.engines.embedded.runner import ModelRunner
from miles_engine.engines.embedded.sequence import Sequence
from miles_engine.engines.embedded.verify import verify


@dataclass
class SpeculationCounters:
    verify_forwards: int = 0  # policy forwards that verified proposals
    verify_rows: int = 0  # row-steps verified (a row in one verify forward)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted + the policy's own tokens, after stop/length cuts

    def stats(self) -> dict[str, float | int]:
        rows = self.verify_rows
        return {
            "spec_verify_steps": self.verify_forwards,
            "spec_verify_rows": rows,
            "spec_proposed_tokens": self.proposed_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0,
            # mean accepted + 1 per row and verify step: tokens a row gains per policy forward
            "spec_acceptance_length": (self.accepted_tokens + rows) / rows if rows else 0.0,
        }


@dataclass
class Backoff:
    """A row's proposal schedule: after ``misses`` >= 2 verify steps in a row with every proposal
    rejected, it waits 2 ** (misses - 2) steps (at most 32) before proposing again."""

    misses: int = 0
    wait: int = 0

    def allows(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2:
            self.wait = min(1 << (self.misses - 2), 32)


@dataclass
class Step:
    tokens: list[list[int]]
    logprobs: list[list[float]]


@dataclass
class SpeculativeDecoder:
    options: SpeculativeOptions
    proposer: Proposer
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    backoff: dict[Sequence, Backoff] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return self.options.num_tokens

    def _uniforms(self, seq: Sequence) -> torch.Tensor | None:
        """This step's draws from the request's generator: k acceptance tests, one for the
        policy's own token, then (draft) k for drafting. A fixed count whatever happens."""
        if seq.params.temperature == 0.0:
            return None
        n = 2 * self.k + 1 if self.proposer.uses_draft_uniforms else self.k + 1
        return torch.rand(n, generator=seq.generator, device=seq.generator.device if seq.generator else None)

    def _schedules(self, seqs: list[Sequence]) -> list[Backoff] | None:
        if not self.options.backoff:
            return None
        if len(self.backoff) > len(seqs):
            live = set(seqs)
            self.backoff = {s: b for s, b in self.backoff.items() if s in live}
        return [self.backoff.setdefault(s, Backoff()) for s in seqs]

    def step(self, runner: ModelRunner, seqs: list[Sequence]) -> Step:
        k = self.k
        schedules = self._schedules(seqs)
        budgets = [min(k, s.max_new_tokens - len(s.output) - 1) for s in seqs]
        if schedules is not None:
            budgets = [b if sch.allows() else 0 for b, sch in zip(budgets, schedules)]
        draws = [self._uniforms(s) for s in seqs]
        proposals, draft_logp = self.proposer.propose(seqs, budgets, [d[k + 1:] if d is not None else None
                                                                      for d in draws])
        q = 1 + max((len(p) for p in proposals), default=0)
        n = len(seqs)
        ids_l: list[list[int]] = []
        pos_l: list[list[int]] = []
        valid_l: list[list[bool]] = []
        first_pos: list[int] = []
        for seq, prop in zip(seqs, proposals):
            start = len(seq.prompt) + len(seq.output) - 1
            fed = len(prop) + 1
            ids_l.append([seq.output[-1], *prop] + [0] * (q - fed))
            pos_l.append([start + min(j, fed - 1) for j in range(q)])  # pads repeat the last position
            valid_l.append([True] * fed + [False] * (q - fed))
            first_pos.append(start)
        ids, pos, valid = torch.tensor(ids_l), torch.tensor(pos_l), torch.tensor(valid_l)
        logits, routing = runner.forward_rows(runner.batch, ids, pos, valid, all_logits=True)
        uniforms = torch.zeros((n, q))
        hot = [r for r, d in enumerate(draws) if d is not None]
        if hot:
            d = torch.stack([draws[r] for r in hot])  # type: ignore[misc]
            uniforms[hot] = torch.cat([d[:, : q - 1], d[:, k : k + 1]], 1)
        verdict = verify(logits.float(), proposals, draft_logp, [s.params for s in seqs], uniforms,
                         invariant=runner.invariant)
        if schedules is not None:
            for sch, prop, acc in zip(schedules, proposals, verdict.accepted):
                sch.record(len(prop), acc)
        tokens, logprobs = [], []
        for seq, toks, lps in zip(seqs, verdict.tokens, verdict.logprobs):
            cut = next((i + 1 for i, t in enumerate(toks) if t in seq.stop_ids), len(toks))
            tokens.append(toks[:cut])
            logprobs.append(lps[:cut])
        emitted = [len(t) for t in tokens]
        runner.batch.keep_new(emitted, q)  # the KV of the fed tokens that are now in the sequence
        self.proposer.rollback(seqs, emitted)
        if routing is not None:
            for r, seq in enumerate(seqs):
                seq.add_routing(routing[r, : emitted[r]], first_pos[r])
        c = self.counters
        c.verify_forwards += 1
        c.verify_rows += n
        c.proposed_tokens += sum(len(p) for p in proposals)
        c.accepted_tokens += sum(verdict.accepted)
        c.emitted_tokens += sum(emitted)
        return Step(tokens, logprobs)


def build_decoder(options: SpeculativeOptions, draft_runner: ModelRunner | None,
                  max_prefill_tokens: int) -> SpeculativeDecoder | None:
    if options.method == "none":
        return None
    if options.method == "ngram":
        return SpeculativeDecoder(options, NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max))
    assert draft_runner is not None
    return SpeculativeDecoder(options, DraftProposer(draft_runner, max_prefill_tokens))
