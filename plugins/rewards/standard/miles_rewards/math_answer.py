"""``math-answer``: 1.0 when the final answer equals the task's reference answer, else 0.0.

The reference is ``task.metadata[answer_key]`` (a number or a string; a reference holding
``\\boxed{}`` or ``#### x``, such as a GSM8K solution, is extracted the same way). An episode with
no answer scores 0.0 (the policy did not answer); a task with no reference cannot be scored and
is an error. See :mod:`miles_rewards.mathnorm` for extraction, normalisation and tolerance.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_rewards.mathnorm import answers_match, extract_answer, normalize
from miles_rewards.text import final_answer, metadata_value


class MathAnswerOptions(Section):
    answer_key: str = Field("answer", description="task metadata key holding the reference answer")
    extract: Literal["auto", "boxed", "last_number"] = Field(
        "auto", description="auto: \\boxed{} → 'answer is'/'####' → last number")
    rel_tol: float = Field(1e-6, ge=0)
    abs_tol: float = Field(1e-9, ge=0)


def reference_text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else None
    if not isinstance(value, str) or not value.strip():
        return None
    if "\\boxed" in value or "\\fbox" in value or "####" in value:
        return extract_answer(value, "auto")
    return value.strip()


class MathAnswer:
    deterministic = True

    def __init__(self, options: MathAnswerOptions) -> None:
        self.options = options

    async def score(self, episode: EpisodeContext) -> RewardResult:
        o = self.options
        task = getattr(episode, "task", None)
        reference = reference_text(metadata_value(task, o.answer_key))
        if reference is None:
            return RewardResult.failed(f"task '{getattr(task, 'id', '?')}' has no usable reference answer in "
                                       f"metadata['{o.answer_key}']")
        text = final_answer(getattr(episode, "transcript", None))
        predicted = extract_answer(text, o.extract) if text is not None else None
        info: dict[str, Any] = {"reference": normalize(reference)[:200]}
        if predicted is None:
            return RewardResult(reward=0.0, components={"answered": 0.0}, info={**info, "predicted": None})
        info["predicted"] = normalize(predicted)[:200]
        match = answers_match(predicted, reference, rel_tol=o.rel_tol, abs_tol=o.abs_tol)
        return RewardResult(reward=float(match), components={"answered": 1.0}, info=info)
