"""The recipe's reward stack scores dataset tasks: `math-answer`, `format` and `llm-judge` read
the row's reference from the task's metadata. A row naming an image and tests is a sandboxed
terminal task: refused by a backend without images, and on the docker backend scored by `pytest`
in its container and by its own default test command."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from miles_engine.environments.capabilities import check_environment
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.hub import Hub
from miles_engine.rewards.config import RewardConfig
from miles_engine.rewards.stack import build_reward_stack
from miles_env_dataset.options import DatasetEnvOptions
from miles_env_dataset.source import DatasetSource

JUDGE_KIT = Path(__file__).parents[3] / "rewards" / "llm-judge" / "tests" / "judge_testkit.py"


def judge_testkit():
    spec = importlib.util.spec_from_file_location("dataset_judge_testkit", JUDGE_KIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source(tmp_path, rows, **options) -> DatasetSource:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DatasetSource(DatasetEnvOptions(path=str(path), cache_dir=str(tmp_path / "cache"), **options))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 240))


def test_math_answer_format_and_llm_judge_score_single_turn_rows(tmp_path):
    kit = judge_testkit()
    src = source(tmp_path, [{"id": "q1", "question": "Ana has 2 pens and gets 3 more. How many?", "answer": 5}],
                 fields={"prompt": "question", "answer": "answer", "task_id": "id"})
    task = src.load_task("q1")

    def grade(prompt: str) -> str:  # a judge that compares the response with the reference it was shown
        reference = prompt.split("[Reference answer]")[1].split("[Response]")[0].strip()
        response = prompt.split("[Response]")[1].split("[Rubric]")[0].strip()
        return "SCORE: 10" if response == reference else "SCORE: 0"

    judge_model = kit.ScriptedJudgeModel(grade)

    async def go():
        async with kit.http_judge(judge_model) as url:
            stack = build_reward_stack(Hub(), RewardConfig(components=[
                {"name": "math-answer"},
                {"name": "format", "weight": 0.1, "options": {"pattern": r"\d+", "match": "fullmatch"}},
                {"name": "llm-judge", "weight": 0.5, "options": {"engine_url": url, "tokenizer": kit.TOKENIZER}},
            ]))
            try:
                scored = []
                for said in ("5", "six", "7"):
                    ctx = EpisodeContext(task=task, sandbox=None,
                                         transcript=[*task.prompt(), {"role": "assistant", "content": said}])
                    scored.append(await stack.score(ctx))
                return scored
            finally:
                await stack.aclose()

    right, words, wrong = run(go())
    assert right.error is None and {k: right.components[k] for k in ("math-answer", "format", "llm-judge")} == {
        "math-answer": 1.0, "format": 1.0, "llm-judge": 1.0}
    assert right.components["llm-judge/judge_score"] == 10.0 and wrong.components["llm-judge/judge_score"] == 0.0
    assert right.reward == pytest.approx(1.6)
    assert words.components["format"] == 0.0 and wrong.components["format"] == 1.0
    assert wrong.reward == pytest.approx(0.1)
    assert "[Reference answer]\n5" in judge_model.prompts[0] and "Ana has 2 pens" in judge_model.prompts[0]


IMAGE_ROW = {"id": "img", "prompt": "make /app/x hold hi", "image": "ubuntu:24.04",
             "tests": "def test_x():\n    assert open('/app/x').read().strip() == 'hi'\n"}
IMAGE_FIELDS = {"prompt": "prompt", "answer": None, "task_id": "id", "image": "image", "tests": "tests"}


def test_a_row_naming_an_image_needs_a_backend_with_images(tmp_path):
    src = source(tmp_path, [IMAGE_ROW], fields=IMAGE_FIELDS, max_turns=4)
    task = src.load_task("img")
    assert task.sandbox_spec().image == "ubuntu:24.04"
    caps = src.capabilities()
    assert caps.needs_sandbox and caps.image and caps.tools == ("bash",)
    local = Hub().create("sandbox", "local", {})
    with pytest.raises(SandboxUnsupportedError, match=r"environment 'dataset' cannot run on sandbox backend "
                                                      r"'local': it needs .*container images"):
        check_environment("dataset", caps, "local", local.capabilities())


def _docker_engine() -> str | None:
    if not os.environ.get("DOCKER_HOST"):
        return "no DOCKER_HOST (scripts/container_engine.sh start provides an engine)"
    from miles_sandbox_docker.options import DockerSandboxOptions

    image = DockerSandboxOptions().image_map.get("ubuntu:24.04", "ubuntu:24.04")  # MILES_DOCKER_IMAGE_MAP
    try:
        probe = subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no docker CLI: {exc}"
    return None if probe.returncode == 0 else f"no local image {image} for ubuntu:24.04"


@pytest.mark.timeout(300)
def test_an_image_row_with_tests_is_a_terminal_task_scored_by_pytest_in_its_container(tmp_path):
    why = _docker_engine()
    if why:
        pytest.skip(why)
    src = source(tmp_path, [IMAGE_ROW], fields=IMAGE_FIELDS, max_turns=4)
    task = src.load_task("img")
    backend = Hub().create("sandbox", "docker", {})
    check_environment("dataset", src.capabilities(), "docker", backend.capabilities())
    stack = build_reward_stack(Hub(), RewardConfig(components=[{"name": "pytest"}, {"name": "task", "weight": 0.0}]))

    async def episode(command: str | None):
        sandbox = await backend.create(task.sandbox_spec())
        try:
            ctx = EpisodeContext(task=task, sandbox=sandbox)
            await task.setup(ctx)  # the row's tests land in /tests
            if command:
                await ctx.call_tool("bash", {"command": command})
            return await stack.score(ctx)
        finally:
            await sandbox.close()

    async def both():
        try:
            return await episode("echo hi > /app/x"), await episode(None)
        finally:
            await stack.aclose()
            await backend.aclose()

    solved, idle = run(both())
    assert solved.error is None, solved.error
    assert (solved.reward, solved.components["pytest/passed"], solved.components["task"]) == (1.0, 1.0, 1.0)
    assert idle.error is None, idle.error
    assert (idle.reward, idle.components["pytest/failed"], idle.components["task"]) == (0.0, 1.0, 0.0)
