"""The teacher protocol: per-token log-probs of given token ids; a teacher never generates.

Alignment convention (the trainer's, see :func:`miles_engine.trainer.losses.token_logprobs`):
index ``i`` of every per-token list holds the value for ``token_ids[i]`` predicted from
``token_ids[:i]``; index 0 has no predicting position and holds 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from miles_engine.errors import MilesError
from miles_engine.teachers.compat import VocabFingerprint


class TeacherError(MilesError):
    """A teacher could not score (unreachable server, malformed answer, bad request)."""


@dataclass(frozen=True)
class ScoreRequest:
    """What to score in one token row.

    :param token_ids: the student's exact row (prompt + sampled + environment ids).
    :param positions: the positions whose teacher distribution is wanted (the sampled tokens,
        ``loss_mask == 1``); every position is in ``1..len(token_ids) - 1``, ascending.
    :param top_k: also return the teacher's ``top_k`` most likely ids at each position (0: none).
    :param candidate_ids: per entry of ``positions``, ids whose teacher log-probs are wanted
        (e.g. the student's top-K); ``None``: none.
    """

    token_ids: Sequence[int]
    positions: Sequence[int]
    top_k: int = 0
    candidate_ids: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 2:
            raise TeacherError(f"a score request needs at least 2 token ids (got {n})")
        prev = 0
        for p in self.positions:
            if not prev < p < n:
                raise TeacherError(f"score request positions must be ascending in 1..{n - 1}; got {list(self.positions)[:20]}")
            prev = p
        if self.top_k < 0:
            raise TeacherError(f"top_k must be >= 0 (got {self.top_k})")
        if self.candidate_ids is not None and len(self.candidate_ids) != len(self.positions):
            raise TeacherError(f"candidate_ids has {len(self.candidate_ids)} entries for {len(self.positions)} positions")


@dataclass
class TokenScores:
    """A teacher's answer for one :class:`ScoreRequest`.

    :param logprobs: one per token id: the teacher's log-prob of ``token_ids[i]`` at every
        requested position, 0.0 elsewhere (index 0 included).
    :param top_ids, top_logprobs: per requested position, the teacher's ``top_k`` ids and
        log-probs, most likely first (empty lists when ``top_k`` was 0).
    :param candidate_logprobs: per requested position, the teacher's log-probs of the
        request's ``candidate_ids`` in the same order (empty when none were asked).
    """

    logprobs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    candidate_logprobs: list[list[float]] = field(default_factory=list)


@runtime_checkable
class Teacher(Protocol):
    """A distillation teacher. Implementations score; they must never sample new tokens."""

    name: str

    def fingerprint(self, probe: str, special_tokens: Sequence[str]) -> VocabFingerprint:
        """The teacher tokenizer's vocabulary size, ids of ``special_tokens`` and ids of ``probe``."""
        ...

    async def score(self, requests: Sequence[ScoreRequest]) -> list[TokenScores]:
        """One :class:`TokenScores` per request, in order. Deterministic for the same ids."""
        ...

    async def aclose(self) -> None: ...
