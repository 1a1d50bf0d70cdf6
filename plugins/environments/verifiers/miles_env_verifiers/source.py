"""A verifiers taskset (``verifiers.v1``, verifiers 0.4.0) as a miles environment source.

The taskset is resolved by verifiers' own plugin rule (``verifiers.v1.tasksets.<id>`` or a
top-level module ``<id>`` exporting one Taskset subclass via ``__all__``) with its own config
type, iterated once (bounded by ``limit``) and kept. Task ids are the tasks' durable
``data.id`` when every task has a distinct one, else their position ``idx``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from miles_engine.environments.capabilities import EnvironmentCapabilities
from miles_engine.environments.protocol import TaskLimits, TaskRef
from miles_engine.errors import ConfigError, TaskFormatError, UnknownComponentError, did_you_mean

from miles_env_verifiers.task import VerifiersTask
from miles_env_verifiers.toolsets import bind_tools, task_toolsets

MAX_LISTED_IDS = 10


def load_taskset(taskset_id: str, config: dict[str, Any]) -> Any:
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import load_taskset as vf_load_taskset
    from verifiers.v1.utils.loaders import taskset_config_type

    try:
        config_type = taskset_config_type(taskset_id)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"environment 'verifiers': cannot load taskset '{taskset_id}': {exc}") from exc
    try:
        taskset_config = config_type.model_validate({**config, "id": taskset_id})
    except ValidationError as exc:
        raise ConfigError(f"environment 'verifiers': invalid config for taskset '{taskset_id}' "
                          f"({config_type.__name__}): {exc}") from exc
    return vf_load_taskset(taskset_config)


class VerifiersSource:
    def __init__(self, taskset_id: str, *, config: dict[str, Any] | None = None, limit: int | None = None,
                 limits: TaskLimits | None = None, name: str = "verifiers") -> None:
        self.name = name
        self.taskset_id = taskset_id
        self.limit = limit
        self.limits = limits or TaskLimits()
        self.taskset = load_taskset(taskset_id, dict(config or {}))
        if not self.taskset.bounded and limit is None:
            raise ConfigError(f"environment 'verifiers': taskset '{taskset_id}' is infinite; set 'limit'")
        self._tasks: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _all(self) -> dict[str, Any]:
        with self._lock:
            if self._tasks is None:
                view = self.taskset.take(self.limit) if self.limit is not None else self.taskset
                tasks = list(view)
                ids = [t.data.id for t in tasks]
                use_ids = all(isinstance(i, str) and i.strip() for i in ids) and len(set(ids)) == len(ids)
                self._tasks = {(str(t.data.id) if use_ids else str(t.data.idx)): t for t in tasks}
            return self._tasks

    def list_tasks(self) -> Iterator[TaskRef]:
        for task_id, task in self._all().items():
            yield TaskRef(id=task_id, description=task.data.description or task.data.name or "",
                          tags=("verifiers", self.taskset_id))

    def load_task(self, task_id: str) -> VerifiersTask:
        tasks = self._all()
        vf_task = tasks.get(task_id)
        if vf_task is None:
            ids = list(tasks)
            shown = ", ".join(ids[:MAX_LISTED_IDS]) + (f", … ({len(ids) - MAX_LISTED_IDS} more)"
                                                     if len(ids) > MAX_LISTED_IDS else "")
            raise UnknownComponentError(f"unknown task '{task_id}' in environment '{self.name}' (taskset "
                                        f"'{self.taskset_id}'){did_you_mean(task_id, ids)}; available ({len(ids)}): "
                                        f"{shown or 'none'}")
        if getattr(vf_task, "NEEDS_CONTAINER", False):
            raise TaskFormatError(f"task '{task_id}' of taskset '{self.taskset_id}' needs a container "
                                  f"({type(vf_task).__name__}.NEEDS_CONTAINER); the miles verifiers adapter runs "
                                  "sandbox-less tasks only")
        return VerifiersTask(task_id, vf_task, task_toolsets(vf_task, self.taskset, task_id), limits=self.limits)

    def capabilities(self) -> EnvironmentCapabilities:
        task_type = self.taskset.task_type()
        tools = bind_tools([*task_type.toolsets(self.taskset.config.task),
                            *type(self.taskset).toolsets(self.taskset.config)], self.taskset_id)
        return EnvironmentCapabilities(needs_sandbox=False, multi_turn=bool(tools) and self.limits.max_turns > 1,
                                       tools=tuple(tools), reference_solution=False)
