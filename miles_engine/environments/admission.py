"""Per-task outcomes: which of an environment's tasks a sandbox backend can run, and why not the others.

One task that asks for a GPU, or uses a feature its format reader does not support, must not sink
the set it is in. :func:`admit_tasks` loads each task, asks for its sandbox spec and checks it
against the backend's capabilities; a task that cannot run is *excluded* with its own reason,
the others go on. ``miles env tasks`` / ``miles env validate`` print the reasons, ``miles eval``
and training leave those tasks out (training says so at start-up and logs
``environment/tasks_excluded``) and refuse to start only when nothing is left.

Kinds of exclusion:

- ``backend``: the task is well-formed, but the backend cannot give what it asks (a GPU, an image,
  sidecars, …); the reason names the need, where the task asks it (a task's optional
  ``need_origin(field) -> str | None``: the file and key) and what would run it.
- ``unsupported``: the task uses a feature of its format the reader does not support
  (:class:`~miles_engine.errors.TaskUnsupportedError`).
- ``malformed``: the task does not load (:class:`~miles_engine.errors.TaskFormatError`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_engine.environments.protocol import EnvironmentSource
from miles_engine.errors import ConfigError, SandboxUnsupportedError, TaskFormatError, TaskUnsupportedError
from miles_engine.sandbox.protocol import Capabilities, UnmetNeed, remedy, unmet_spec_needs

ExclusionKind = Literal["backend", "unsupported", "malformed"]
EXCLUSION_KINDS: tuple[ExclusionKind, ...] = ("backend", "unsupported", "malformed")
TASKS_EXCLUDED = "environment/tasks_excluded"
TASKS_ADMITTED = "environment/tasks_admitted"
SHOWN_REASONS = 20  # per-task reasons printed in a start-up summary; the rest are counted


@dataclass(frozen=True)
class ExcludedTask:
    task_id: str
    kind: ExclusionKind
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"task": self.task_id, "kind": self.kind, "reason": self.reason}


@dataclass
class TaskAdmission:
    """The outcome over a task set: ids admitted (in listing order) and those excluded, each with its reason."""

    environment: str
    backend: str | None
    admitted: list[str] = field(default_factory=list)
    excluded: list[ExcludedTask] = field(default_factory=list)

    @property
    def excluded_ids(self) -> set[str]:
        return {e.task_id for e in self.excluded}

    def reason(self, task_id: str) -> ExcludedTask | None:
        return next((e for e in self.excluded if e.task_id == task_id), None)

    def counts(self) -> Counter[str]:
        return Counter(e.kind for e in self.excluded)

    def metrics(self) -> dict[str, float]:
        """``environment/tasks_excluded`` (and per kind) and ``environment/tasks_admitted``."""
        counts = self.counts()
        out = {TASKS_EXCLUDED: float(len(self.excluded)), TASKS_ADMITTED: float(len(self.admitted))}
        out.update({f"{TASKS_EXCLUDED}/{kind}": float(counts[kind]) for kind in EXCLUSION_KINDS})
        return out

    def summary(self) -> str:
        """One line: how many tasks are excluded, of how many, by kind."""
        total = len(self.admitted) + len(self.excluded)
        on = f" on sandbox backend '{self.backend}'" if self.backend else ""
        if not self.excluded:
            return f"environment '{self.environment}': all {total} task(s) can run{on}"
        counts = self.counts()
        kinds = ", ".join(f"{counts[k]} {_KIND_WORDS[k]}" for k in EXCLUSION_KINDS if counts[k])
        return (f"environment '{self.environment}': {len(self.excluded)} of {total} task(s) excluded{on} "
                f"({kinds}); {len(self.admitted)} left")

    def report(self, limit: int = SHOWN_REASONS) -> str:
        """The summary and each excluded task's reason (the first ``limit``; the rest counted)."""
        lines = [self.summary()]
        # a task listed several times (a mixture's ``repeat``: ``id#1``, ``id#2``...) is shown once
        listings = Counter(_listed_task(e.task_id) for e in self.excluded)
        first: dict[str, ExcludedTask] = {}
        for e in self.excluded:
            first.setdefault(_listed_task(e.task_id), e)
        shown = list(first.values())
        for e in shown[:limit]:
            times = listings[_listed_task(e.task_id)]
            lines.append(f"  - {e.task_id}{f' (listed {times} times)' if times > 1 else ''} [{e.kind}]: {e.reason}")
        if len(shown) > limit:
            lines.append(f"  … and {len(shown) - limit} more excluded task(s)")
        return "\n".join(lines)

    def require_some(self, what: str = "to run") -> None:
        """Refuse (one error with every reason shown) when no task is left: a
        :class:`SandboxUnsupportedError` when the backend refused them all, else a :class:`ConfigError`."""
        if not self.admitted:
            error = SandboxUnsupportedError if self.counts().keys() == {"backend"} else ConfigError
            raise error(f"nothing {what}: {self.report()}")


def _listed_task(task_id: str) -> str:
    return task_id.split("#", 1)[0]


_KIND_WORDS = {"backend": "the backend cannot run", "unsupported": "unsupported", "malformed": "malformed"}


def _need_line(task: Any, need: UnmetNeed) -> str:
    origin = getattr(task, "need_origin", None)
    where = origin(need.field) if callable(origin) else None
    return f"{need.text} ({where})" if where else need.text


def _task_file(task: Any) -> str:
    path = getattr(task, "metadata", {}).get("path") if isinstance(getattr(task, "metadata", None), dict) else None
    return f" ({path})" if path else ""


def admit_task(source: EnvironmentSource, task_id: str, backend: str | None,
               caps: Capabilities | None) -> ExcludedTask | None:
    """``None`` when ``backend`` (with ``caps``; ``None``: no sandbox backend) can run the task,
    else why not."""
    try:
        task = source.load_task(task_id)
        spec = task.sandbox_spec()
    except SandboxUnsupportedError as exc:
        return ExcludedTask(task_id, "backend", str(exc))
    except TaskUnsupportedError as exc:
        return ExcludedTask(task_id, "unsupported", str(exc))
    except TaskFormatError as exc:
        return ExcludedTask(task_id, "malformed", str(exc))
    if spec is None:
        return None
    if caps is None:
        needs = [UnmetNeed("sandbox", "a sandbox (none configured)")]
    else:
        needs = unmet_spec_needs(spec, caps)
    if not needs:
        return None
    who = f"sandbox backend '{backend}'" if backend else "no sandbox backend"
    return ExcludedTask(task_id, "backend",
                        f"task '{task_id}'{_task_file(task)} needs {'; '.join(_need_line(task, n) for n in needs)}, "
                        f"which {who} cannot give; what would run it: {remedy(needs, backend)}")


def admit_tasks(source: EnvironmentSource, backend: str | None, caps: Capabilities | None, *,
                task_ids: Iterable[str] | None = None) -> TaskAdmission:
    """The per-task outcome over ``task_ids`` (default: every listed task)."""
    ids = list(task_ids) if task_ids is not None else [ref.id for ref in source.list_tasks()]
    admission = TaskAdmission(getattr(source, "name", type(source).__name__), backend)
    for task_id in dict.fromkeys(ids):
        excluded = admit_task(source, task_id, backend, caps)
        if excluded is None:
            admission.admitted.append(task_id)
        else:
            admission.excluded.append(excluded)
    return admission


def admit_on(source: EnvironmentSource, backend_name: str | None, backend: Any | None, *,
             task_ids: Iterable[str] | None = None) -> TaskAdmission:
    """:func:`admit_tasks` against a built backend (a ``SandboxBackend``, or ``None``)."""
    return admit_tasks(source, backend_name, backend.capabilities() if backend is not None else None,
                       task_ids=task_ids)
