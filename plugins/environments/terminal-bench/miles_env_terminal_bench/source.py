"""A directory of terminal-bench task directories (or one task directory) as an environment source.

Listing is lazy and cheap (it reads only ``difficulty``/``tags``/``category`` leniently and never
fails on one malformed task); :meth:`TerminalBenchSource.load_task` validates and names faults.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from miles_engine.environments.capabilities import EnvironmentCapabilities
from miles_engine.environments.directory import DirectoryTaskSource
from miles_engine.environments.protocol import TaskRef

from miles_env_terminal_bench.task import Network, TerminalBenchTask, load_tb_task


def _quick_ref(task_id: str, task_dir: Path) -> TaskRef:
    try:
        raw = yaml.safe_load((task_dir / "task.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return TaskRef(id=task_id)
    if not isinstance(raw, dict):
        return TaskRef(id=task_id)
    tags = raw.get("tags") if isinstance(raw.get("tags"), list) else []
    difficulty = raw.get("difficulty")
    return TaskRef(id=task_id, difficulty=str(difficulty) if difficulty is not None else None,
                   tags=tuple(str(t) for t in tags), description=str(raw.get("category") or ""))


class TerminalBenchSource(DirectoryTaskSource):
    """terminal-bench tasks under ``path`` (a directory of task directories, or one task).

    :param name: the environment name shown in listings and errors.
    :param include: / :param exclude: glob patterns on task ids.
    :param ignore_dockerfile: run on the backend's default userland instead of building the
        task's Dockerfile (you accept fidelity loss: packages the image installs are missing).
    :param network: the network every task gets (task.yaml declares none); default ``none``.
    """

    task_file = "task.yaml"

    def __init__(self, path: str | Path, *, name: str = "terminal-bench", include: Sequence[str] = (),
                 exclude: Sequence[str] = (), ignore_dockerfile: bool = False, network: Network = "none") -> None:
        super().__init__(path, name=name, include=include, exclude=exclude)
        self.ignore_dockerfile = ignore_dockerfile
        self.network: Network = network

    def quick_ref(self, task_id: str, task_dir: Path) -> TaskRef:
        return _quick_ref(task_id, task_dir)

    def load_dir(self, task_dir: Path, task_id: str) -> TerminalBenchTask:
        return load_tb_task(task_dir, task_id=task_id, source=self.name, ignore_dockerfile=self.ignore_dockerfile,
                            network=self.network)

    def capabilities(self) -> EnvironmentCapabilities:
        """The widest needs over every task that loads (a malformed one is the validator's to report)."""
        return self.capabilities_with(
            lambda t: (t.task_dir / "solution.sh").is_file() or (t.task_dir / "solution.yaml").is_file())
