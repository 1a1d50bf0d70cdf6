"""A directory of Harbor task directories (or one task directory) as an environment source.

Reusable by other plugins that ship Harbor-format tasks as package data::

    from miles_env_harbor import HarborSource
    source = HarborSource(Path(__file__).parent / "tasks", name="terminal-tasks")

Listing is lazy and cheap: it reads only each ``task.toml``'s ``[metadata]``/``[task]`` keys
and never fails because one task is malformed — :meth:`HarborSource.load_task` validates the
task fully and names what is wrong, so a validator can report every broken task by id.
"""

from __future__ import annotations

import fnmatch
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from miles_engine.environments.capabilities import EnvironmentCapabilities, capabilities_of_tasks
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import TaskFormatError, UnknownComponentError, did_you_mean

from miles_env_harbor.task import DefaultNetwork, HarborTask, load_harbor_task

MAX_LISTED_IDS = 10


def _is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "instruction.md").is_file()


def unknown_task_error(source: str, task_id: str, available: Sequence[str]) -> UnknownComponentError:
    """An unknown id: did-you-mean, and a few of the available ids (not thousands)."""
    shown = ", ".join(available[:MAX_LISTED_IDS])
    more = f", … ({len(available) - MAX_LISTED_IDS} more)" if len(available) > MAX_LISTED_IDS else ""
    listing = f"{shown}{more}" if available else "none"
    return UnknownComponentError(
        f"unknown task '{task_id}' in environment '{source}'{did_you_mean(task_id, available)}; "
        f"available ({len(available)}): {listing}"
    )


def _quick_ref(task_id: str, task_dir: Path) -> TaskRef:
    """A TaskRef from a lenient read of task.toml (no validation; broken files list by id only)."""
    try:
        raw: dict[str, Any] = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return TaskRef(id=task_id)
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    info = raw.get("task") if isinstance(raw.get("task"), dict) else {}
    tags = meta.get("tags") or []
    tags = [tags] if isinstance(tags, str) else [str(t) for t in tags] if isinstance(tags, list) else []
    keywords = info.get("keywords") if isinstance(info.get("keywords"), list) else []
    difficulty = meta.get("difficulty")
    description = info.get("description") or meta.get("description") or ""
    return TaskRef(
        id=task_id,
        difficulty=str(difficulty) if difficulty is not None else None,
        tags=tuple(dict.fromkeys([*tags, *(str(k) for k in keywords)])),
        description=str(description),
    )


class HarborSource:
    """Harbor tasks under ``path``: a directory of task directories, or a single task directory.

    :param path: the dataset directory (each subdirectory holding ``task.toml`` or
        ``instruction.md`` is a task, its id is the directory name), or one task directory.
    :param name: the environment name shown in listings and errors.
    :param include: glob patterns on task ids; when given, only matching tasks are listed.
    :param exclude: glob patterns on task ids to leave out.
    :param ignore_dockerfile: run every task on the backend's default userland, ignoring
        ``docker_image`` and Dockerfiles (you accept the fidelity loss).
    :param default_network: network for tasks whose task.toml declares none (``network_mode`` /
        ``allow_internet``). Harbor's implicit default is public; miles defaults to ``none``.

    Subclasses may set :attr:`task_class` to a :class:`HarborTask` subclass to load their own tasks.
    """

    task_class: type[HarborTask] = HarborTask

    def __init__(self, path: str | Path, *, name: str = "harbor", include: Sequence[str] = (),
                 exclude: Sequence[str] = (), ignore_dockerfile: bool = False,
                 default_network: DefaultNetwork = "none") -> None:
        self.path = Path(path).expanduser()
        self.name = name
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.ignore_dockerfile = ignore_dockerfile
        self.default_network: DefaultNetwork = default_network
        if not self.path.is_dir():
            raise TaskFormatError(f"environment '{name}': task directory {self.path} does not exist")

    @property
    def single_task(self) -> bool:
        return (self.path / "task.toml").is_file()

    def _selected(self, task_id: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(task_id, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(task_id, p) for p in self.exclude)

    def _task_dirs(self) -> Iterator[tuple[str, Path]]:
        if self.single_task:
            yield self.path.name, self.path
            return
        for child in sorted(self.path.iterdir()):
            if child.is_dir() and not child.name.startswith((".", "_")) and _is_task_dir(child):
                if self._selected(child.name):
                    yield child.name, child

    def task_ids(self) -> list[str]:
        return [task_id for task_id, _ in self._task_dirs()]

    def list_tasks(self) -> Iterator[TaskRef]:
        for task_id, task_dir in self._task_dirs():
            yield _quick_ref(task_id, task_dir)

    def load_task(self, task_id: str) -> HarborTask:
        if self.single_task:
            task_dir, known = self.path, task_id == self.path.name
        else:
            task_dir = self.path / task_id
            known = "/" not in task_id and task_id not in ("", ".", "..") and task_dir.is_dir()
        if not known or not self._selected(task_id):
            raise unknown_task_error(self.name, task_id, self.task_ids())
        return load_harbor_task(task_dir, task_id=task_id, source=self.name, ignore_dockerfile=self.ignore_dockerfile,
                                default_network=self.default_network, task_class=self.task_class)

    def task_split(self, task_id: str) -> str | None:
        """The split a task declares in its task.toml, ``[metadata] split = "train" | "eval" | "test"``
        (``eval.split.by: source``); ``None`` when it declares none."""
        task_dir = self.path if self.single_task else self.path / task_id
        try:
            raw = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None
        meta = raw.get("metadata")
        split = meta.get("split") if isinstance(meta, dict) else None
        return str(split) if split is not None else None

    def capabilities(self) -> EnvironmentCapabilities:
        """The widest needs over every task that loads (a malformed one is the validator's to report)."""
        tasks = []
        for task_id in self.task_ids():
            try:
                tasks.append(self.load_task(task_id))
            except (TaskFormatError, UnknownComponentError):
                continue
        solved = bool(tasks) and all((t.solution_dir / "solve.sh").is_file() for t in tasks)
        return capabilities_of_tasks(tasks, reference_solution=solved)

    def __repr__(self) -> str:
        return f"HarborSource(name={self.name!r}, path={str(self.path)!r})"
