"""Harbor's reward files: the rules live in :mod:`miles_engine.rewards.files` (shared with the
``test-script`` / ``reward-file`` reward components); re-exported here under their old names."""

from __future__ import annotations

from miles_engine.rewards.files import (
    MAX_REWARD_FILE_BYTES,
    REWARD_JSON,
    REWARD_TXT,
    TEST_STDOUT,
    VERIFIER_DIR,
    parse_reward_json,
    parse_reward_txt,
    reward_result,
    scalar_reward,
)

__all__ = [
    "MAX_REWARD_FILE_BYTES",
    "REWARD_JSON",
    "REWARD_TXT",
    "TEST_STDOUT",
    "VERIFIER_DIR",
    "parse_reward_json",
    "parse_reward_txt",
    "reward_result",
    "scalar_reward",
]
