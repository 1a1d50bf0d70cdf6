"""Verification exactly as Harbor's ``Verifier.verify`` does it, on any miles sandbox.

Shared mode (the default) verifies in the agent's sandbox:

1. remove stale ``/logs/verifier/reward.{txt,json}`` and ``test-stdout.txt`` (an agent or an
   earlier run cannot leave a reward behind);
2. upload ``tests/`` to ``/tests`` (only now: the agent never sees the tests);
3. run ``bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1`` with ``[verifier].env``
   (``${VAR}`` templates filled from the host), as ``[verifier].user``, under
   ``[verifier].timeout_sec``; its exit code is recorded but, as in Harbor, does not decide;
4. read ``reward.json`` if present, else ``reward.txt`` (see :mod:`miles_env_harbor.rewards`).

Separate mode (``[verifier].environment_mode = "separate"``) copies ``/logs/artifacts`` and the
task's declared ``artifacts`` out of the agent's sandbox, creates a fresh verifier sandbox through
the factory the episode runner puts in ``ctx.info["sandbox_factory"]`` (an
``async (SandboxSpec) -> Sandbox`` callable such as ``backend.create``), restores the artifacts
at their original absolute paths there, runs the steps above in it and closes it.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.errors import MilesError, RewardError
from miles_engine.sandbox.protocol import Sandbox, SandboxSpec

from miles_env_harbor.config import resolve_env
from miles_env_harbor.rewards import (
    MAX_REWARD_FILE_BYTES,
    REWARD_JSON,
    REWARD_TXT,
    TEST_STDOUT,
    VERIFIER_DIR,
    parse_reward_json,
    parse_reward_txt,
    reward_result,
)

if TYPE_CHECKING:
    from miles_env_harbor.task import HarborTask

SANDBOX_FACTORY_KEY = "sandbox_factory"
SandboxFactory = Callable[[SandboxSpec], Awaitable[Sandbox]]
ARTIFACTS_DIR = "/logs/artifacts"

MAKE_LOG_DIRS = "mkdir -p /logs/agent /logs/verifier /logs/artifacts"
CLEAR_REWARDS = f"mkdir -p {VERIFIER_DIR} /tests && rm -f {REWARD_JSON} {REWARD_TXT} {TEST_STDOUT}"
CLEAR_TESTS = "mkdir -p /tests && find /tests -mindepth 1 -delete"
RUN_TESTS = f"bash /tests/test.sh > {TEST_STDOUT} 2>&1"
FIND_REWARDS = f'for f in {REWARD_JSON} {REWARD_TXT}; do if [ -f "$f" ]; then echo "$f"; fi; done'
TAIL_STDOUT = f"tail -c 2000 {TEST_STDOUT} 2>/dev/null || true"


def path_kind_command(path: str) -> str:
    q = shlex.quote(path)
    return f"if [ -d {q} ]; then echo dir; elif [ -f {q} ]; then echo file; else echo none; fi"


async def make_log_dirs(sandbox: Sandbox) -> None:
    result = await sandbox.exec(MAKE_LOG_DIRS, timeout_s=30)
    if not result.ok:
        raise RuntimeError(f"cannot create Harbor log directories: {(result.stderr or result.stdout).strip()}")


async def _tail(sandbox: Sandbox) -> str:
    return (await sandbox.exec(TAIL_STDOUT, timeout_s=30)).stdout


@dataclass(frozen=True)
class TestPlan:
    """What one verification uploads and runs: ``tests_dirs`` copied into ``/tests`` in order (a
    step's own tests over the task's shared ones), ``script`` (for messages), ``env`` before
    ``${VAR}`` templating, and the timeout and user."""

    tests_dirs: tuple[Path, ...]
    script: str
    env: dict[str, str]
    env_where: str
    timeout_s: float
    user: str | int | None
    clear_tests: bool = False  # empty /tests first (a step must not see the previous step's tests)


def task_test_plan(task: HarborTask) -> TestPlan:
    ver = task.config.verifier
    return TestPlan(tests_dirs=(task.tests_dir,), script="tests/test.sh", env=dict(ver.env),
                    env_where=f"{task.toml_path} [verifier].env", timeout_s=ver.timeout_sec, user=ver.user)


async def run_tests(task: HarborTask, sandbox: Sandbox, plan: TestPlan | None = None) -> RewardResult:
    """Steps 1–4 of the module docstring in ``sandbox``; never raises for a bad reward."""
    plan = plan or task_test_plan(task)
    where = f"task '{task.id}'"
    try:
        env = resolve_env(plan.env, where=plan.env_where)
    except MilesError as exc:
        return RewardResult.failed(f"{where}: {exc}")
    prep = await sandbox.exec(CLEAR_TESTS + " && " + CLEAR_REWARDS if plan.clear_tests else CLEAR_REWARDS, timeout_s=30)
    if not prep.ok:
        return RewardResult.failed(f"{where}: cannot clear stale reward files: {(prep.stderr or prep.stdout).strip()}")
    for tests_dir in plan.tests_dirs:
        await sandbox.upload_dir(tests_dir, "/tests")
    timeout = plan.timeout_s
    user = plan.user
    run = await sandbox.exec(
        RUN_TESTS, env=env or None, timeout_s=timeout, **({"user": str(user)} if user is not None else {})
    )
    info: dict[str, Any] = {"test_exit_code": run.exit_code, "test_duration_s": round(run.duration_s, 3)}
    if run.timed_out:
        return RewardResult.failed(f"{where}: {plan.script} timed out after {timeout:g}s",
                                   **info, test_stdout_tail=await _tail(sandbox))
    found = (await sandbox.exec(FIND_REWARDS, timeout_s=30)).stdout.split()
    path = REWARD_JSON if REWARD_JSON in found else REWARD_TXT if REWARD_TXT in found else None
    if path is None:
        return RewardResult.failed(
            f"{where}: {plan.script} wrote no reward (neither {REWARD_JSON} nor {REWARD_TXT} exists; "
            f"test.sh exit code {run.exit_code})",
            **info, test_stdout_tail=await _tail(sandbox),
        )
    try:
        data = await sandbox.read_file(path, max_bytes=MAX_REWARD_FILE_BYTES)
        parse = parse_reward_json if path == REWARD_JSON else parse_reward_txt
        rewards = parse(data, where=f"{where}: {path}")
    except RewardError as exc:
        return RewardResult.failed(str(exc), **info, test_stdout_tail=await _tail(sandbox))
    except Exception as exc:  # a sandbox read failure is this task's error, not a crashed batch
        return RewardResult.failed(f"{where}: cannot read {path}: {type(exc).__name__}: {exc}", **info)
    result = reward_result(rewards, source=path, **info)
    if result.reward is not None and result.reward < 1.0:  # the why of a partial score, for the logs
        result.info["test_stdout_tail"] = await _tail(sandbox)
    return result


async def copy_out(sandbox: Sandbox, path: str, local: Path) -> str | None:
    """Copy ``path`` (a file or a directory) out of ``sandbox`` to ``local``; its kind
    (``"file"`` / ``"dir"``), or ``None`` when it does not exist."""
    kind = (await sandbox.exec(path_kind_command(path), timeout_s=30)).stdout.strip()
    if kind == "dir":
        local.mkdir(parents=True, exist_ok=True)
        await sandbox.download_dir(path, local)
    elif kind == "file":
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(await sandbox.read_file(path))
    else:
        return None
    return kind


async def collect_artifacts(sandbox: Sandbox, paths: list[str], local_root: Path) -> list[tuple[str, str]]:
    """Copy each existing path out of ``sandbox`` under ``local_root``; return ``(path, kind)``."""
    collected: list[tuple[str, str]] = []
    for path in dict.fromkeys([ARTIFACTS_DIR, *paths]):
        kind = await copy_out(sandbox, path, local_root / path.lstrip("/"))
        if kind is not None:
            collected.append((path, kind))
    return collected


async def restore_artifacts(sandbox: Sandbox, collected: list[tuple[str, str]], local_root: Path) -> None:
    for path, kind in collected:
        local = local_root / path.lstrip("/")
        target_dir = path if kind == "dir" else str(Path(path).parent)
        await sandbox.exec(f"mkdir -p {shlex.quote(target_dir)}", timeout_s=30)
        if kind == "dir":
            await sandbox.upload_dir(local, path)
        else:
            await sandbox.write_file(path, local.read_bytes())


async def verify_separate(task: HarborTask, ctx: EpisodeContext) -> RewardResult:
    where = f"task '{task.id}'"
    factory: SandboxFactory | None = ctx.info.get(SANDBOX_FACTORY_KEY)
    if factory is None:
        return RewardResult.failed(
            f"{where} sets [verifier].environment_mode = 'separate', which verifies in a second, fresh "
            f"sandbox, but the episode runner provided no sandbox factory (ctx.info['{SANDBOX_FACTORY_KEY}'])"
        )
    spec = task.verifier_sandbox_spec()
    with tempfile.TemporaryDirectory(prefix="miles-harbor-artifacts-") as tmp:
        root = Path(tmp)
        collected = await collect_artifacts(ctx.sandbox, task.config.artifact_paths(), root) if ctx.sandbox else []
        verifier_sandbox = await factory(spec)
        try:
            await make_log_dirs(verifier_sandbox)
            await restore_artifacts(verifier_sandbox, collected, root)
            result = await run_tests(task, verifier_sandbox)
        finally:
            await verifier_sandbox.close()
    result.info["verifier_mode"] = "separate"
    result.info["artifacts"] = [path for path, _ in collected]
    return result
