"""Options of the ``shell-drills`` environment (validated; unknown keys are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_env_terminal_tasks.drills.words import WORD_RE, default_words

DrillKind = Literal["echo", "calc", "write-file", "count", "grep"]
ALL_KINDS: tuple[DrillKind, ...] = ("echo", "calc", "write-file", "count", "grep")
CalcOp = Literal["+", "-", "*"]


class DrillOptions(BaseModel):
    """How drills are generated. Same options + same task id → the same instance, always."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kinds: list[DrillKind] = Field(
        default_factory=lambda: list(ALL_KINDS), min_length=1,
        description="drill kinds to list (task i has kind kinds[i % len(kinds)])",
    )
    seed: int = Field(0, description="seed of every generated instance")
    num_tasks: int = Field(1000, ge=1, le=100_000_000, description="how many task ids list_tasks yields")
    operand_digits_min: int = Field(2, ge=1, le=9, description="calc: fewest digits of an operand")
    operand_digits_max: int = Field(2, ge=1, le=9, description="calc: most digits of an operand")
    calc_ops: list[CalcOp] = Field(default_factory=lambda: ["+"], min_length=1, description="calc: operators")
    calc_require_tool: bool = Field(False, description="calc: score 0 unless bash was called before the answer")
    file_lines_min: int = Field(3, ge=2, le=2000, description="count/grep: fewest lines of the generated file")
    file_lines_max: int = Field(8, ge=2, le=2000, description="count/grep: most lines of the generated file")
    words: list[str] | None = Field(None, description="explicit word pool (lower-case letters only)")
    word_pool_size: int = Field(200, ge=8, le=5000, description="size of the default invented-word pool")
    max_turns: int = Field(4, ge=1, le=64, description="assistant turns an agent gets")
    command_timeout_s: float = Field(10.0, gt=0, le=600, description="timeout of one bash call")
    demo_wrong_fraction: float = Field(
        0.65, ge=0.0, le=1.0, description="share of demonstrations that are deliberately wrong"
    )
    demo_no_tool_share: float | None = Field(
        None, ge=0.0, le=1.0,
        description="share of the wrong demonstrations that answer without calling bash "
        "(None: as often as any other kind of mistake)",
    )

    @field_validator("kinds", "calc_ops")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        dups = sorted({x for x in v if v.count(x) > 1})
        if dups:
            raise ValueError(f"duplicate entries {dups}")
        return v

    @field_validator("words")
    @classmethod
    def _word_pool(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        bad = [w for w in v if not WORD_RE.match(w)]
        if bad:
            raise ValueError(f"words must be 2-16 lower-case ASCII letters; bad: {bad[:5]}")
        if len(set(v)) < 8:
            raise ValueError(f"need at least 8 distinct words, got {len(set(v))}")
        return v

    @model_validator(mode="after")
    def _ranges(self) -> DrillOptions:
        if self.operand_digits_min > self.operand_digits_max:
            raise ValueError(
                f"operand_digits_min ({self.operand_digits_min}) > operand_digits_max ({self.operand_digits_max})"
            )
        if self.file_lines_min > self.file_lines_max:
            raise ValueError(f"file_lines_min ({self.file_lines_min}) > file_lines_max ({self.file_lines_max})")
        return self

    def word_pool(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.words)) if self.words else default_words(self.word_pool_size)
