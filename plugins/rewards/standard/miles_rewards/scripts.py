"""``test-script`` and ``reward-file``: score by what a script run in the episode's sandbox says.

``test-script`` uploads ``tests_dir`` (host) to ``tests_target`` (sandbox), removes stale reward
files, runs ``command`` and scores by Harbor's rules (:mod:`miles_engine.rewards.files`):
``reward.json`` wins over ``reward.txt`` in ``verifier_dir``. With ``score: auto`` a script that
writes no reward file is scored by its exit code (1.0 on 0, else 0.0: terminal-bench's
``run-tests.sh`` convention); ``reward_file`` makes a missing file an error, ``exit_code``
ignores reward files. A timed-out script is an error, never a zero.

``reward-file`` runs nothing: it reads the reward files something else (the task, the agent's
own test run) left in ``verifier_dir``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.errors import RewardError
from miles_engine.rewards.files import VERIFIER_DIR, clear_rewards_command, read_reward_files, reward_result
from miles_engine.rewards.protocol import describe_error

TAIL_CHARS = 2000


class RewardFileOptions(Section):
    verifier_dir: str = Field(VERIFIER_DIR, description="directory holding reward.json / reward.txt")


class ScriptOptions(Section):
    command: str = Field(min_length=1, description="shell command run in the sandbox, e.g. 'bash /tests/test.sh'")
    tests_dir: str | None = Field(None, description="host directory uploaded to tests_target before the run")
    tests_target: str = Field("/tests", description="where tests_dir lands in the sandbox")
    verifier_dir: str = Field(VERIFIER_DIR, description="directory the script writes reward.json / reward.txt to")
    score: Literal["auto", "reward_file", "exit_code"] = "auto"
    timeout_s: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = Field(None, description="directory the command runs in (default: the sandbox's)")


def _tail(text: str) -> str:
    return text[-TAIL_CHARS:]


def _where(episode: EpisodeContext) -> str:
    return f"task '{getattr(getattr(episode, 'task', None), 'id', '?')}'"


async def read_rewards(episode: EpisodeContext, verifier_dir: str, **info: Any) -> RewardResult | None:
    """The verdict of the reward files in ``verifier_dir``; ``None`` when there are none."""
    where = _where(episode)
    try:
        found = await read_reward_files(episode.sandbox, verifier_dir, where=where)
    except RewardError as exc:
        return RewardResult.failed(str(exc), **info)
    if found is None:
        return None
    path, rewards = found
    return reward_result(rewards, source=path, **info)


class RewardFile:
    deterministic = True

    def __init__(self, options: RewardFileOptions) -> None:
        self.options = options

    async def score(self, episode: EpisodeContext) -> RewardResult:
        if getattr(episode, "sandbox", None) is None:
            return RewardResult.failed(f"{_where(episode)}: reward-file needs the episode's sandbox; it has none")
        try:
            result = await read_rewards(episode, self.options.verifier_dir)
        except Exception as exc:  # noqa: BLE001 - a sandbox failure is this episode's error
            return RewardResult.failed(f"{_where(episode)}: cannot read reward files: {describe_error(exc)}")
        if result is None:
            return RewardResult.failed(f"{_where(episode)}: no reward file (neither reward.json nor reward.txt "
                                       f"in {self.options.verifier_dir})")
        return result


class ScriptVerifier:
    deterministic = True  # as deterministic as the script it runs

    def __init__(self, options: ScriptOptions) -> None:
        self.options = options
        if options.tests_dir is not None and not Path(options.tests_dir).is_dir():
            from miles_engine.errors import ConfigError

            raise ConfigError(f"test-script: tests_dir '{options.tests_dir}' is not a directory")

    async def score(self, episode: EpisodeContext) -> RewardResult:
        where = _where(episode)
        if getattr(episode, "sandbox", None) is None:
            return RewardResult.failed(f"{where}: test-script needs the episode's sandbox; it has none")
        try:
            return await self._run(episode)
        except Exception as exc:  # noqa: BLE001 - a sandbox failure is this episode's error
            return RewardResult.failed(f"{where}: test-script could not run: {describe_error(exc)}")

    async def _run(self, episode: EpisodeContext) -> RewardResult:
        o, sandbox, where = self.options, episode.sandbox, _where(episode)
        assert sandbox is not None
        prep = await sandbox.exec(clear_rewards_command(o.verifier_dir), timeout_s=30)
        if not prep.ok:
            return RewardResult.failed(f"{where}: cannot clear stale reward files in {o.verifier_dir}: "
                                       f"{(prep.stderr or prep.stdout).strip()}")
        if o.tests_dir is not None:
            await sandbox.exec(f"mkdir -p {shlex.quote(o.tests_target)}", timeout_s=30)
            await sandbox.upload_dir(Path(o.tests_dir), o.tests_target)
        command = f"cd {shlex.quote(o.workdir)} && {o.command}" if o.workdir else o.command
        run = await sandbox.exec(command, env=o.env or None, timeout_s=o.timeout_s)
        info: dict[str, Any] = {"exit_code": run.exit_code, "duration_s": round(run.duration_s, 3),
                                "output_tail": _tail(run.stdout + run.stderr)}
        if run.timed_out:
            return RewardResult.failed(f"{where}: test command timed out after {o.timeout_s:g}s", **info)
        if o.score != "exit_code":
            found = await read_rewards(episode, o.verifier_dir, **info)
            if found is not None:
                return found
            if o.score == "reward_file":
                return RewardResult.failed(f"{where}: the test command wrote no reward file (neither reward.json nor "
                                           f"reward.txt in {o.verifier_dir}; exit code {run.exit_code})", **info)
        if run.exit_code is None:
            return RewardResult.failed(f"{where}: the test command reported no exit code", **info)
        return RewardResult(reward=1.0 if run.exit_code == 0 else 0.0, components={"passed": float(run.exit_code == 0)},
                            info={**info, "scored_by": "exit_code"})
