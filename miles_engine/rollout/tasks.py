"""The task stream the scheduler draws groups from: cyclic over an environment's tasks, with a
seeded shuffle per epoch. It yields :class:`TaskRef` handles (cheap); the driver's
``run_trajectory`` loads a fresh task object per attempt (``source.load_task(ref.id)``), so the
n concurrent attempts of a group never share task state."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator

from miles_engine.environments.protocol import EnvironmentSource, TaskRef
from miles_engine.errors import ConfigError


class TaskStream:
    """``for ref in TaskStream(source, seed=0)`` cycles forever (``epochs=None``) or ``epochs`` times.

    ``task_ids`` keeps only those ids (unknown ids are an error); ``task_filter(ref) -> bool``
    filters further. An empty task set after filtering raises :class:`ConfigError` here, at
    construction, before anything runs."""

    def __init__(self, source: EnvironmentSource | Iterable[TaskRef], *, seed: int = 0, shuffle: bool = True,
                 epochs: int | None = None, task_ids: Iterable[str] | None = None,
                 task_filter: Callable[[TaskRef], bool] | None = None) -> None:
        name = getattr(source, "name", type(source).__name__)
        refs = list(source.list_tasks() if hasattr(source, "list_tasks") else source)
        listed = len(refs)
        if task_ids is not None:
            wanted = list(task_ids)
            known = {r.id for r in refs}
            missing = [t for t in wanted if t not in known]
            if missing:
                raise ConfigError(f"environment '{name}' has no task(s) {', '.join(map(repr, missing[:5]))}"
                                  f" (it lists {listed} tasks)")
            keep = set(wanted)
            refs = [r for r in refs if r.id in keep]
        if task_filter is not None:
            refs = [r for r in refs if task_filter(r)]
        if not refs:
            why = "lists no tasks" if listed == 0 else f"lists {listed} tasks but none is left after filtering"
            raise ConfigError(f"environment '{name}' {why}: nothing to train on")
        if epochs is not None and epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None (cycle forever), got {epochs}")
        self.refs = refs
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self) -> Iterator[TaskRef]:
        rng = random.Random(self.seed)
        self.epoch = 0
        while self.epochs is None or self.epoch < self.epochs:
            order = list(self.refs)
            if self.shuffle:
                rng.shuffle(order)
            yield from order
            self.epoch += 1
