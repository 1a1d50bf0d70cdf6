"""The packaged terminal tasks: format checks, and every task scores oracle 1.0 / no-op 0.0 on
the local sandbox (the same check as ``miles env validate terminal-tasks``)."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import pytest

from miles_engine.environments.protocol import EpisodeContext
from miles_engine.hub import default_hub
from miles_engine.rollout.validate import validate_environment
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub
from miles_engine.sandbox.protocol import unmet_needs
from miles_env_terminal_tasks import TASKS_DIR, PackagedTask, packaged_source

TASK_DIRS = sorted(p for p in TASKS_DIR.iterdir() if p.is_dir())
DIFFICULTIES = {"easy", "medium", "hard"}


def _backend():
    """The local sandbox; skip (saying why) where this machine cannot give it the /app paths."""
    backend = Hub().create("sandbox", "local")
    needs = unmet_needs(packaged_source().load_task("hello-file").sandbox_spec(), backend.capabilities())
    if needs:
        pytest.skip(f"local sandbox cannot run these tasks here: it needs {'; '.join(needs)}")
    return backend


def test_task_set_is_large_and_mixed() -> None:
    assert len(TASK_DIRS) >= 30
    difficulties = [tomllib.loads((d / "task.toml").read_text())["metadata"]["difficulty"] for d in TASK_DIRS]
    assert set(difficulties) == DIFFICULTIES
    assert min(difficulties.count(x) for x in DIFFICULTIES) >= 4


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=[d.name for d in TASK_DIRS])
def test_task_directory_format(task_dir: Path) -> None:
    config = tomllib.loads((task_dir / "task.toml").read_text())
    assert config["schema_version"] == "1.4"
    meta = config["metadata"]
    assert meta["difficulty"] in DIFFICULTIES and meta["category"] and meta["tags"]
    env = config["environment"]
    assert "docker_image" not in env and not (task_dir / "environment" / "Dockerfile").exists()
    assert env["network_mode"] == "no-network" and env["workdir"] == "/app"
    assert config["agent"]["timeout_sec"] > 0 and config["verifier"]["timeout_sec"] > 0
    assert "/app" in (task_dir / "instruction.md").read_text()
    test_sh = (task_dir / "tests" / "test.sh").read_text()
    # the verifier writes 0 first, so every early exit leaves a 0 (never a missing reward)
    assert "echo 0 > /logs/verifier/reward.txt" in test_sh.split("echo 1 >")[0]
    assert (task_dir / "solution" / "solve.sh").is_file()


def test_registered_with_options() -> None:
    hub = Hub()
    source = hub.create("environment", "terminal-tasks")
    ids = [ref.id for ref in source.list_tasks()]
    assert ids == [d.name for d in TASK_DIRS]
    hard = hub.create("environment", "terminal-tasks", {"difficulty": ["hard"]})
    hard_refs = list(hard.list_tasks())
    assert hard_refs and all(ref.difficulty == "hard" for ref in hard_refs)
    only = hub.create("environment", "terminal-tasks", {"include": ["fix-*"], "exclude": ["fix-etl-script"]})
    assert {ref.id for ref in only.list_tasks()} == {"fix-backup-script", "fix-median", "fix-paginate"}
    task = source.load_task("hello-file")
    assert isinstance(task, PackagedTask) and task.prompt()[0]["role"] == "user"
    for bad in ({"difficulty": ["trivial"]}, {"includes": ["x"]}):
        with pytest.raises(ConfigError):
            hub.create("environment", "terminal-tasks", bad)


def test_every_task_oracle_scores_1_and_nop_scores_0() -> None:
    checks = asyncio.run(validate_environment(packaged_source(), _backend(), hub=default_hub(), jobs=4))
    failed = [f"{c.task_id}: {'; '.join(c.problems)}" for c in checks if not c.passed]
    assert not failed, "\n".join(failed)
    assert len(checks) == len(TASK_DIRS)


# Plausible but wrong attempts must score 0: the verifiers check what the instruction asks.
NAIVE_ATTEMPTS = {
    "log-error-count": "grep -c ERROR app.log > error_count.txt",
    "symlink-latest": "ln -s /app/releases/$(ls releases | tail -n 1) /app/current",
    "sort-unique-names": "sort -f -u names.txt > unique.txt; wc -l < unique.txt > count.txt",
    "tsv-admins": "grep admin users.tsv | cut -f2 > admins.txt",
    "clean-tmp-files": "rm -rf $(find workspace -name '*.tmp')",
    "crlf-script": "chmod +x tools/greet.sh",
    "fix-paginate": "sed -i 's/len(items) - page_size/len(items) - 1/' pager.py",
    "json-deep-merge": "python3 -c 'import json; d = json.load(open(\"defaults.json\")); "
                       "d.update(json.load(open(\"overrides.json\"))); json.dump(d, open(\"config.json\", \"w\"))'",
}


def test_naive_attempts_score_0() -> None:
    source, backend = packaged_source(), _backend()

    async def attempt(task_id: str, command: str) -> tuple[str, float | None]:
        task = source.load_task(task_id)
        async with await backend.create(task.sandbox_spec()) as sandbox:
            ctx = EpisodeContext(task=task, sandbox=sandbox)
            await task.setup(ctx)
            await ctx.call_tool("bash", {"command": command})
            return task_id, (await task.verify(ctx)).reward

    async def main() -> list[tuple[str, float | None]]:
        gate = asyncio.Semaphore(4)

        async def one(item: tuple[str, str]) -> tuple[str, float | None]:
            async with gate:
                return await attempt(*item)

        return await asyncio.gather(*(one(item) for item in NAIVE_ATTEMPTS.items()))

    results = dict(asyncio.run(main()))
    assert results == {task_id: 0.0 for task_id in NAIVE_ATTEMPTS}
