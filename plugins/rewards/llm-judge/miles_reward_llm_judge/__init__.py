"""An LLM judge reward: renders a grading prompt, generates through a miles engine, parses the verdict."""

from miles_reward_llm_judge.judge import JudgeOptions, LLMJudge
from miles_reward_llm_judge.verdict import VerdictError, parse_verdict

__all__ = ["JudgeOptions", "LLMJudge", "VerdictError", "parse_verdict"]
