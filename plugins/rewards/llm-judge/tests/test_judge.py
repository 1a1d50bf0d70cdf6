"""The judge through a real SGLang-compatible HTTP server (scripted model) and the embedded engine."""

from __future__ import annotations

import asyncio

import pytest
from judge_testkit import TOKENIZER, ScriptedJudgeModel, codec, grade_paris, http_judge

from miles_engine.environments.protocol import EpisodeContext
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub, default_hub
from miles_engine.testing.reward import RewardContract, SampleEpisode, SampleTask
from miles_reward_llm_judge import JudgeOptions, LLMJudge


def episode(answer: str, reference: str | None = "Paris") -> EpisodeContext:
    return EpisodeContext(task=SampleTask("capital", {"answer": reference} if reference else {}, sandbox=False),
                          sandbox=None, transcript=[{"role": "user", "content": "Capital of France?"},
                                                    {"role": "assistant", "content": answer}])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_http_judge_scores_through_the_sglang_wire():
    model = ScriptedJudgeModel(grade_paris)

    async def go():
        async with http_judge(model) as url:
            judge = Hub().create("reward", "llm-judge", {"engine_url": url, "tokenizer": TOKENIZER})
            try:
                return [await judge.score(episode(a)) for a in ("It is Paris.", "Lyon {obviously}")]
            finally:
                await judge.aclose()

    right, wrong = run(go())
    assert (right.reward, right.components, right.error) == (1.0, {"judge_score": 10.0}, None)
    assert (wrong.reward, wrong.error) == (0.0, None)
    prompt = model.prompts[1]
    assert "Capital of France?" in prompt and "Lyon {obviously}" in prompt and "[Reference answer]\nParis" in prompt


@pytest.mark.parametrize(("reply", "needle"), [
    (lambda p: "Looks fine to me!", "no verdict"), (lambda p: "SCORE: 42", "outside 0..10"), (lambda p: "", "empty answer"),
])
def test_garbage_verdict_fails_the_reward(reply, needle):
    async def go():
        async with http_judge(ScriptedJudgeModel(reply)) as url:
            judge = LLMJudge(JudgeOptions(engine_url=url, tokenizer=TOKENIZER), hub=default_hub())
            try:
                return await judge.score(episode("Paris")), url
            finally:
                await judge.aclose()

    result, url = run(go())
    assert result.reward is None and needle in result.error and url in result.error


def test_unreachable_server_fails_naming_the_url():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = LLMJudge(JudgeOptions(engine_url=f"http://127.0.0.1:{port}", tokenizer=TOKENIZER, timeout_s=20),
                     hub=default_hub())
    result = run(judge.score(episode("Paris")))
    run(judge.aclose())
    assert result.reward is None and f"http://127.0.0.1:{port}" in result.error and "did not answer" in result.error


@pytest.mark.parametrize(("options", "needle"), [
    ({}, "exactly one of `engine_url`"),
    ({"engine_url": "http://x", "model": "m"}, "exactly one of"),
    ({"engine_url": "http://x"}, "set `tokenizer`"),
    ({"model": "tiny:qwen3"}, "set `tokenizer`"),
    ({"model": "/m", "template": "no placeholder"}, "must contain {response}"),
    ({"model": "/m", "scale": 0}, "greater than 0"),
])
def test_bad_options(options, needle):
    with pytest.raises(ConfigError, match=needle):
        Hub().create("reward", "llm-judge", options)


@pytest.mark.slow
def test_embedded_engine_judge_with_a_random_model_fails_cleanly():
    """The in-process path end to end: a tiny random model says nothing readable → a failed reward."""
    vocab = codec().tokenizer.vocab_size
    judge = Hub().create("reward", "llm-judge", {"model": f"tiny:qwen3,vocab_size={vocab}", "tokenizer": TOKENIZER,
                                                 "max_new_tokens": 8})

    async def go():
        try:
            return await judge.score(episode("Paris")), await judge.score(episode("Lyon"))
        finally:
            await judge.aclose()

    for result in run(go()):
        assert result.reward is None and "embedded engine (tiny:qwen3" in result.error
        assert "no verdict" in result.error or "empty answer" in result.error


class TestJudgeContract(RewardContract):
    component = "llm-judge"
    options = {"engine_url": "http://127.0.0.1:9", "tokenizer": TOKENIZER}  # built, never called
    deterministic = True  # the scripted model is

    def make_reward(self):
        return LLMJudge(JudgeOptions(**self.options), engine=ScriptedJudgeModel(grade_paris), codec=codec())

    def sample_episodes(self):
        conv = [{"role": "user", "content": "Capital of France?"}]
        return [SampleEpisode("right", conv + [{"role": "assistant", "content": "Paris"}], {"answer": "Paris"}, 1.0),
                SampleEpisode("wrong", conv + [{"role": "assistant", "content": "Rome"}], {"answer": "Paris"}, 0.0),
                SampleEpisode("silent", conv, {}, 0.0)]
