"""Shaping terms: ``format`` (does the answer look as asked) and ``length`` (overlong penalty).

``format`` scores 1.0 when the final answer (or every assistant message, ``target: all``) matches
``pattern`` (a regular expression; ``search`` anywhere or ``fullmatch`` the whole text), else 0.0;
``require_boxed`` is the common shortcut for ``\\boxed{...}``.

``length`` measures the assistant's text (characters or whitespace-separated words, over every
assistant message) and returns a penalty in [-1, 0]: 0 up to ``soft_limit``, falling linearly to
-1 at ``hard_limit`` and -1 beyond (DAPO's overlong shaping). Weight it in the stack to scale it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles_engine.components import Section
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_rewards.text import assistant_texts, final_answer

MAX_MATCH_CHARS = 100_000  # a runaway answer is judged on its tail


class FormatOptions(Section):
    pattern: str | None = Field(None, description="regular expression the text must match")
    require_boxed: bool = Field(False, description="the text must contain \\boxed{...}")
    match: Literal["search", "fullmatch"] = "search"
    target: Literal["final", "all"] = Field("final", description="the final answer, or every assistant message")
    ignore_case: bool = False
    dotall: bool = True

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"pattern {v!r} is not a valid regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _something(self) -> FormatOptions:
        if self.pattern is None and not self.require_boxed:
            raise ValueError("set `pattern` or `require_boxed: true`")
        return self


class FormatCheck:
    deterministic = True

    def __init__(self, options: FormatOptions) -> None:
        self.options = options
        flags = (re.IGNORECASE if options.ignore_case else 0) | (re.DOTALL if options.dotall else 0)
        self.regex = re.compile(options.pattern, flags) if options.pattern is not None else None

    def _ok(self, text: str) -> bool:
        text = text[-MAX_MATCH_CHARS:]
        if self.options.require_boxed and not re.search(r"\\boxed\s*\{", text):
            return False
        if self.regex is None:
            return True
        found = self.regex.fullmatch(text) if self.options.match == "fullmatch" else self.regex.search(text)
        return found is not None

    async def score(self, episode: EpisodeContext) -> RewardResult:
        transcript = getattr(episode, "transcript", None)
        if self.options.target == "final":
            text = final_answer(transcript)
            texts = [text] if text is not None else []
        else:
            texts = [t for t in assistant_texts(transcript) if t.strip()]
        ok = bool(texts) and all(self._ok(t) for t in texts)
        return RewardResult(reward=float(ok), info={"checked_messages": len(texts)})


class LengthOptions(Section):
    unit: Literal["chars", "words"] = "words"
    soft_limit: int = Field(ge=0, description="no penalty up to this length")
    hard_limit: int = Field(gt=0, description="full penalty (-1) from this length on")

    @model_validator(mode="after")
    def _ordered(self) -> LengthOptions:
        if self.hard_limit <= self.soft_limit:
            raise ValueError(f"hard_limit ({self.hard_limit}) must be greater than soft_limit ({self.soft_limit})")
        return self


class LengthPenalty:
    deterministic = True

    def __init__(self, options: LengthOptions) -> None:
        self.options = options

    def measure(self, texts: list[str]) -> int:
        if self.options.unit == "chars":
            return sum(len(t) for t in texts)
        return sum(len(t.split()) for t in texts)

    async def score(self, episode: EpisodeContext) -> RewardResult:
        o = self.options
        length = self.measure(assistant_texts(getattr(episode, "transcript", None)))
        over = (length - o.soft_limit) / (o.hard_limit - o.soft_limit)
        penalty = -min(max(over, 0.0), 1.0)
        return RewardResult(reward=penalty, components={"length": float(length)})
