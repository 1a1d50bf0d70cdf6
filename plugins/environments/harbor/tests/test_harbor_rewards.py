"""reward.txt / reward.json parsing and the scalar chosen from Harbor's reward map."""

from __future__ import annotations

import pytest

from miles_engine.errors import RewardError
from miles_env_harbor.rewards import parse_reward_json, parse_reward_txt, reward_result, scalar_reward

W = "task 't': /logs/verifier/reward.txt"


@pytest.mark.parametrize(("data", "value"), [(b"1", 1.0), (b"0\n", 0.0), (b" 0.25 \n", 0.25), (b"1e0", 1.0), (b"-1", -1.0)])
def test_reward_txt_numbers(data, value):
    assert parse_reward_txt(data, where=W) == {"reward": value}


@pytest.mark.parametrize(
    ("data", "needle"),
    [(b"", "reward file is empty"), (b"  \n", "does not hold one number"), (b"pass\n", "does not hold one number: 'pass'"),
     (b"1,0", "does not hold one number"), (b"nan", "is nan, not a finite number"), (b"inf\n", "is inf"),
     (b"\xff\xfe", "does not hold one number")],
)
def test_reward_txt_garbage_names_task_and_file(data, needle):
    with pytest.raises(RewardError, match=rf"^task 't': /logs/verifier/reward\.txt: .*{needle}"):
        parse_reward_txt(data, where=W)


def test_reward_json_flat_map():
    assert parse_reward_json(b'{"reward": 1, "speed": 0.5}', where="w") == {"reward": 1.0, "speed": 0.5}


@pytest.mark.parametrize(
    ("data", "needle"),
    [(b"", "empty"), (b"{", "not valid JSON"), (b"[1]", "JSON object of name"), (b"{}", "empty object"),
     (b'{"reward": "1"}', "'reward' must be a number, got str"), (b'{"ok": true}', "'ok' must be a number, got bool"),
     (b'{"a": {"b": 1}}', "'a' must be a number, got dict"), (b'{"a": NaN}', "'a' is nan"),
     (b'{"a": null}', "got NoneType")],
)
def test_reward_json_garbage(data, needle):
    with pytest.raises(RewardError, match=needle):
        parse_reward_json(data, where="task 't': /logs/verifier/reward.json")


@pytest.mark.parametrize(
    ("rewards", "scalar"),
    [({"reward": 0.5}, 0.5), ({"reward": 1.0, "speed": 0.0}, 1.0), ({"correctness": 0.25}, 0.25),
     ({"a": 1.0, "b": 0.0}, 0.5)],
)
def test_scalar_rule(rewards, scalar):
    assert scalar_reward(rewards) == scalar


def test_reward_result_keeps_every_component():
    result = reward_result({"a": 1.0, "b": 0.0}, source="/logs/verifier/reward.json", test_exit_code=0)
    assert result.reward == 0.5 and result.components == {"a": 1.0, "b": 0.0} and result.error is None
    assert result.info == {"reward_file": "/logs/verifier/reward.json", "test_exit_code": 0}
