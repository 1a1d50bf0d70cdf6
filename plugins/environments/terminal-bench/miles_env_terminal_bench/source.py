"""A directory of terminal-bench task directories (or one task directory) as an environment source.

Listing is lazy and cheap (it reads only ``difficulty``/``tags``/``category`` leniently and never
fails on one malformed task); :meth:`TerminalBenchSource.load_task` validates and names faults.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

from miles_engine.environments.capabilities import EnvironmentCapabilities, capabilities_of_tasks
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import TaskFormatError, UnknownComponentError, did_you_mean

from miles_env_terminal_bench.task import Network, TerminalBenchTask, load_tb_task

MAX_LISTED_IDS = 10


def unknown_task_error(source: str, task_id: str, available: Sequence[str]) -> UnknownComponentError:
    shown = ", ".join(available[:MAX_LISTED_IDS])
    more = f", … ({len(available) - MAX_LISTED_IDS} more)" if len(available) > MAX_LISTED_IDS else ""
    return UnknownComponentError(
        f"unknown task '{task_id}' in environment '{source}'{did_you_mean(task_id, available)}; "
        f"available ({len(available)}): {shown + more if available else 'none'}"
    )


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


class TerminalBenchSource:
    """terminal-bench tasks under ``path`` (a directory of task directories, or one task).

    :param name: the environment name shown in listings and errors.
    :param include: / :param exclude: glob patterns on task ids.
    :param ignore_dockerfile: run on the backend's default userland instead of building the
        task's Dockerfile (you accept fidelity loss: packages the image installs are missing).
    :param network: the network every task gets (task.yaml declares none); default ``none``.
    """

    def __init__(self, path: str | Path, *, name: str = "terminal-bench", include: Sequence[str] = (),
                 exclude: Sequence[str] = (), ignore_dockerfile: bool = False, network: Network = "none") -> None:
        self.path = Path(path).expanduser()
        self.name = name
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.ignore_dockerfile = ignore_dockerfile
        self.network: Network = network
        if not self.path.is_dir():
            raise TaskFormatError(f"environment '{name}': task directory {self.path} does not exist")

    @property
    def single_task(self) -> bool:
        return (self.path / "task.yaml").is_file()

    def _selected(self, task_id: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(task_id, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(task_id, p) for p in self.exclude)

    def _task_dirs(self) -> Iterator[tuple[str, Path]]:
        if self.single_task:
            yield self.path.name, self.path
            return
        for child in sorted(self.path.iterdir()):
            if child.is_dir() and not child.name.startswith((".", "_")) and (child / "task.yaml").is_file():
                if self._selected(child.name):
                    yield child.name, child

    def task_ids(self) -> list[str]:
        return [task_id for task_id, _ in self._task_dirs()]

    def list_tasks(self) -> Iterator[TaskRef]:
        for task_id, task_dir in self._task_dirs():
            yield _quick_ref(task_id, task_dir)

    def load_task(self, task_id: str) -> TerminalBenchTask:
        if self.single_task:
            task_dir, known = self.path, task_id == self.path.name
        else:
            task_dir = self.path / task_id
            known = "/" not in task_id and task_id not in ("", ".", "..") and (task_dir / "task.yaml").is_file()
        if not known or not self._selected(task_id):
            raise unknown_task_error(self.name, task_id, self.task_ids())
        return load_tb_task(task_dir, task_id=task_id, source=self.name,
                            ignore_dockerfile=self.ignore_dockerfile, network=self.network)

    def capabilities(self) -> EnvironmentCapabilities:
        """The widest needs over every task that loads (a malformed one is the validator's to report)."""
        tasks = []
        for task_id in self.task_ids():
            try:
                tasks.append(self.load_task(task_id))
            except (TaskFormatError, UnknownComponentError):
                continue
        solved = bool(tasks) and all((t.task_dir / "solution.sh").is_file() or (t.task_dir / "solution.yaml").is_file()
                                     for t in tasks)
        return capabilities_of_tasks(tasks, reference_solution=solved)

    def __repr__(self) -> str:
        return f"TerminalBenchSource(name={self.name!r}, path={str(self.path)!r})"
