"""A directory of Harbor task directories (or one task directory) as an environment source.

Reusable by other plugins that ship Harbor-format tasks as package data::

    from miles_env_harbor import HarborSource
    source = HarborSource(Path(__file__).parent / "tasks", name="terminal-tasks")

Listing is lazy and cheap: it reads only each ``task.toml``'s ``[metadata]``/``[task]`` keys
and never fails because one task is malformed — :meth:`HarborSource.load_task` validates the
task fully and names what is wrong, so a validator can report every broken task by id.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_engine.environments.capabilities import EnvironmentCapabilities
from miles_engine.environments.directory import DirectoryTaskSource
from miles_engine.environments.protocol import TaskRef

from miles_env_harbor.task import DefaultNetwork, HarborTask, load_harbor_task


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


class HarborSource(DirectoryTaskSource):
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
    task_file = "task.toml"

    def __init__(self, path: str | Path, *, name: str = "harbor", include: Sequence[str] = (),
                 exclude: Sequence[str] = (), ignore_dockerfile: bool = False,
                 default_network: DefaultNetwork = "none") -> None:
        super().__init__(path, name=name, include=include, exclude=exclude)
        self.ignore_dockerfile = ignore_dockerfile
        self.default_network: DefaultNetwork = default_network

    def is_task_dir(self, path: Path) -> bool:
        return (path / "task.toml").is_file() or (path / "instruction.md").is_file()

    def loadable(self, path: Path) -> bool:
        return path.is_dir()  # a directory missing its files is the loader's to name

    def quick_ref(self, task_id: str, task_dir: Path) -> TaskRef:
        return _quick_ref(task_id, task_dir)

    def load_dir(self, task_dir: Path, task_id: str) -> HarborTask:
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
        return self.capabilities_with(lambda t: t.has_reference_solution)
