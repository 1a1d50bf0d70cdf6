"""Tasks as directories: a directory of task directories (or one task directory) as an environment
source, for the formats that ship tasks that way (Harbor's ``task.toml``, terminal-bench's
``task.yaml``). A task's id is its directory's name; ``include`` / ``exclude`` glob patterns on
ids select them. Listing is lazy and cheap and never fails on one malformed task (``quick_ref``
reads leniently); ``load_task`` validates fully and names what is wrong, so a validator can report
every broken task by id.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from miles_engine.environments.capabilities import EnvironmentCapabilities, capabilities_of_tasks
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import TaskFormatError, UnknownComponentError, did_you_mean

MAX_LISTED_IDS = 10


def unknown_task_error(source: str, task_id: str, available: Sequence[str]) -> UnknownComponentError:
    """An unknown id: did-you-mean, and a few of the available ids (not thousands)."""
    shown = ", ".join(available[:MAX_LISTED_IDS])
    more = f", … ({len(available) - MAX_LISTED_IDS} more)" if len(available) > MAX_LISTED_IDS else ""
    return UnknownComponentError(
        f"unknown task '{task_id}' in environment '{source}'{did_you_mean(task_id, available)}; "
        f"available ({len(available)}): {shown + more if available else 'none'}"
    )


class DirectoryTaskSource:
    """The listing, selection and id checks every task-directory format shares.

    A subclass names its task file (:attr:`task_file`), reads a listing entry cheaply
    (:meth:`quick_ref`) and loads one task (:meth:`load_dir`).
    """

    task_file: str = ""  # the file that makes a directory a task (and ``path`` itself a single task)

    def __init__(self, path: str | Path, *, name: str, include: Sequence[str] = (),
                 exclude: Sequence[str] = ()) -> None:
        self.path = Path(path).expanduser()
        self.name = name
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        if self.path.is_file():
            raise TaskFormatError(f"environment '{name}': path {self.path} is a file; this environment reads a "
                                  f"directory of task directories, or one task directory (holding {self.task_file})")
        if not self.path.is_dir():
            raise TaskFormatError(f"environment '{name}': task directory {self.path} does not exist")

    # ------------------------------------------------------------------ what a subclass says
    def is_task_dir(self, path: Path) -> bool:
        """Whether a subdirectory is listed as a task."""
        return (path / self.task_file).is_file()

    def loadable(self, path: Path) -> bool:
        """Whether ``load_task`` tries a directory named by id (default: listed ones only)."""
        return self.is_task_dir(path)

    def quick_ref(self, task_id: str, task_dir: Path) -> TaskRef:
        return TaskRef(id=task_id)

    def load_dir(self, task_dir: Path, task_id: str) -> Any:
        """The task in ``task_dir``: every format's source implements it (Harbor's, terminal-bench's)."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_dir(task_dir, task_id)")

    # ------------------------------------------------------------------ the source
    @property
    def single_task(self) -> bool:
        return (self.path / self.task_file).is_file()

    def selected(self, task_id: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(task_id, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(task_id, p) for p in self.exclude)

    def task_dirs(self) -> Iterator[tuple[str, Path]]:
        if self.single_task:
            yield self.path.name, self.path
            return
        for child in sorted(self.path.iterdir()):
            if child.is_dir() and not child.name.startswith((".", "_")) and self.is_task_dir(child):
                if self.selected(child.name):
                    yield child.name, child

    def task_ids(self) -> list[str]:
        return [task_id for task_id, _ in self.task_dirs()]

    def list_tasks(self) -> Iterator[TaskRef]:
        for task_id, task_dir in self.task_dirs():
            yield self.quick_ref(task_id, task_dir)

    def task_dir(self, task_id: str) -> Path:
        """The directory of ``task_id``; an unknown (or unselected) id is one error listing some known ones."""
        if self.single_task:
            task_dir, known = self.path, task_id == self.path.name
        else:
            task_dir = self.path / task_id
            known = "/" not in task_id and task_id not in ("", ".", "..") and self.loadable(task_dir)
        if not known or not self.selected(task_id):
            raise unknown_task_error(self.name, task_id, self.task_ids())
        return task_dir

    def load_task(self, task_id: str) -> Any:
        return self.load_dir(self.task_dir(task_id), task_id)

    def loaded_tasks(self) -> list[Any]:
        """Every task that loads (a malformed one is the validator's to report)."""
        tasks = []
        for task_id in self.task_ids():
            try:
                tasks.append(self.load_task(task_id))
            except (TaskFormatError, UnknownComponentError):
                continue
        return tasks

    def capabilities_with(self, solved: Callable[[Any], bool]) -> EnvironmentCapabilities:
        """The widest needs over every task that loads; a reference solution when every task has one."""
        tasks = self.loaded_tasks()
        return capabilities_of_tasks(tasks, reference_solution=bool(tasks) and all(solved(t) for t in tasks))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, path={str(self.path)!r})"
