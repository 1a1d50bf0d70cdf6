"""Every component of miles-rewards passes the reward contract suite."""

from __future__ import annotations

import json

from rewards_testkit import real_pytest_run, said

from miles_engine.testing.reward import FAILED, RewardContract, SampleEpisode

VDIR = "logs/verifier"  # relative: works on every local-sandbox isolation tier


def script(name: str, body: str, expected, **kw) -> SampleEpisode:
    return SampleEpisode(name, said("done"), files={"check.sh": body}, expected=expected, **kw)


class TestScriptContract(RewardContract):
    component = "test-script"
    options = {"command": "bash check.sh", "verifier_dir": VDIR, "timeout_s": 20}
    deterministic = True

    def sample_episodes(self):
        return [
            script("reward.txt", f"echo 0.75 > {VDIR}/reward.txt", 0.75),
            script("reward.json wins", f"echo 0 > {VDIR}/reward.txt; echo '{{\"reward\": 1, \"style\": 0.5}}' "
                                       f"> {VDIR}/reward.json", 1.0),
            script("exit 0 without a file", "true", 1.0),
            script("exit 3 without a file", "exit 3", 0.0),
            script("garbage reward file", f"echo lots > {VDIR}/reward.txt", FAILED),
            script("stale file from the agent is removed", "exit 1", 0.0,
                   commands=[f"mkdir -p {VDIR} && echo 1 > {VDIR}/reward.txt"]),
            SampleEpisode("no script at all", said("done"), needs_sandbox=True, expected=0.0),
        ]


class TestRewardFileContract(RewardContract):
    component = "reward-file"
    options = {"verifier_dir": VDIR}
    deterministic = True

    def sample_episodes(self):
        return [
            SampleEpisode("txt", said("x"), files={f"{VDIR}/reward.txt": "0.25\n"}, expected=0.25),
            SampleEpisode("json mean of keys", said("x"),
                          files={f"{VDIR}/reward.json": json.dumps({"a": 1, "b": 0})}, expected=0.5),
            SampleEpisode("nan", said("x"), files={f"{VDIR}/reward.txt": "nan"}, expected=FAILED),
            SampleEpisode("boolean", said("x"), files={f"{VDIR}/reward.json": '{"reward": true}'}, expected=FAILED),
            SampleEpisode("nothing written", said("x"), needs_sandbox=True, expected=FAILED),
        ]


class TestPytestContract(RewardContract):
    component = "pytest"
    options = {"command": "cat out.txt 2>/dev/null; exit 1", "junit_path": "report.xml", "timeout_s": 20}
    deterministic = True

    def sample_episodes(self):
        junit, output = real_pytest_run()
        return [
            SampleEpisode("real junit report", said("x"), files={"report.xml": junit, "out.txt": output}, expected=0.5),
            SampleEpisode("summary line only", said("x"), files={"out.txt": output}, expected=0.5),
            SampleEpisode("quiet summary", said("x"), files={"out.txt": "..F\n2 passed, 1 failed in 0.03s\n"},
                          expected=2 / 3),
            SampleEpisode("no tests ran", said("x"), files={"out.txt": "no tests ran in 0.01s\n"}, expected=FAILED),
            SampleEpisode("garbage report", said("x"), files={"report.xml": "<html>not junit"}, expected=FAILED),
            SampleEpisode("no output", said("x"), needs_sandbox=True, expected=FAILED),
        ]


class TestMathAnswerContract(RewardContract):
    component = "math-answer"
    deterministic = True

    def sample_episodes(self):
        return [
            SampleEpisode("boxed fraction", said(r"so \boxed{\frac{3}{4}}"), {"answer": "0.75"}, 1.0),
            SampleEpisode("gsm8k reference", said("It costs 1,200 dollars."), {"answer": "... #### 1200"}, 1.0),
            SampleEpisode("numeric reference", said(r"\boxed{2.50}"), {"answer": 2.5}, 1.0),
            SampleEpisode("wrong", said(r"\boxed{7}"), {"answer": "8"}, 0.0),
            SampleEpisode("no answer", said("I do not know"), {"answer": "8"}, 0.0),
            SampleEpisode("no reference", said(r"\boxed{7}"), {}, FAILED),
        ]


class TestFormatContract(RewardContract):
    component = "format"
    options = {"pattern": r"^<think>.*</think>", "require_boxed": True}
    deterministic = True

    def sample_episodes(self):
        return [
            SampleEpisode("both", said(r"<think>hm</think> \boxed{1}"), expected=1.0),
            SampleEpisode("no box", said("<think>hm</think> 1"), expected=0.0),
            SampleEpisode("no think", said(r"\boxed{1}"), expected=0.0),
            SampleEpisode("silent", [], expected=0.0),
        ]


class TestLengthContract(RewardContract):
    component = "length"
    options = {"unit": "words", "soft_limit": 4, "hard_limit": 8}
    deterministic = True

    def sample_episodes(self):
        return [
            SampleEpisode("short", said("one two"), expected=0.0),
            SampleEpisode("half over", said("a b c", "d e f"), expected=-0.5),
            SampleEpisode("far over", said("w " * 50), expected=-1.0),
        ]
