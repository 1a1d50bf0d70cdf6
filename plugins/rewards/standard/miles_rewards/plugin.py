"""Registers the reward components of ``miles-rewards``."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component

from miles_rewards.math_answer import MathAnswer, MathAnswerOptions
from miles_rewards.pytest_fraction import PytestFraction, PytestOptions
from miles_rewards.scripts import RewardFile, RewardFileOptions, ScriptOptions, ScriptVerifier
from miles_rewards.terms import FormatCheck, FormatOptions, LengthOptions, LengthPenalty


@hookimpl
def miles_register_rewards() -> list[Component]:
    return [
        Component("test-script", ScriptVerifier, options=ScriptOptions,
                  description="run a script in the sandbox; Harbor reward.json/reward.txt, else its exit code"),
        Component("reward-file", RewardFile, options=RewardFileOptions,
                  description="read Harbor reward.json / reward.txt left in the sandbox"),
        Component("pytest", PytestFraction, options=PytestOptions,
                  description="fraction of pytest tests passed (JUnit XML or summary line)"),
        Component("math-answer", MathAnswer, options=MathAnswerOptions,
                  description="final answer (\\boxed{} / last number) equals metadata['answer'], numerically"),
        Component("format", FormatCheck, options=FormatOptions,
                  description="1 when the answer matches a regular expression / has \\boxed{}"),
        Component("length", LengthPenalty, options=LengthOptions,
                  description="overlong penalty in [-1, 0] past soft_limit (chars or words)"),
    ]
