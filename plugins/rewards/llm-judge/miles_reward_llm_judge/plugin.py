"""Registers the ``llm-judge`` reward."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component

from miles_reward_llm_judge.judge import JudgeOptions, LLMJudge


@hookimpl
def miles_register_rewards() -> list[Component]:
    return [Component("llm-judge", LLMJudge, options=JudgeOptions, takes_hub=True,
                      description="asks a model (embedded engine or SGLang-compatible server) for a 0..scale score")]
