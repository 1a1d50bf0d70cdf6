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
        return self.iter_from(0)

    def _orders(self) -> Iterator[list[TaskRef]]:
        """Each epoch's order; the same sequence for the same seed (one rng, shuffled per epoch)."""
        rng = random.Random(self.seed)
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = list(self.refs)
            if self.shuffle:
                rng.shuffle(order)
            yield order
            epoch += 1

    def iter_from(self, position: int) -> Iterator[TaskRef]:
        """The stream from its ``position``-th task on (0: the start): a resumed run continues
        the same data order from its checkpointed cursor."""
        if position < 0:
            raise ValueError(f"task stream position must be >= 0, got {position}")
        first_epoch, offset = divmod(position, len(self.refs))
        self.epoch = 0
        for epoch, order in enumerate(self._orders()):
            self.epoch = epoch
            if epoch >= first_epoch:
                yield from order[offset if epoch == first_epoch else 0:]
        self.epoch = self.epochs if self.epochs is not None else self.epoch

    def at(self, position: int) -> TaskRef:
        """The task at ``position`` of the stream (for a checkpoint's requeued groups)."""
        epoch_wanted, offset = divmod(position, len(self.refs))
        for epoch, order in enumerate(self._orders()):
            if epoch == epoch_wanted:
                return order[offset]
        raise IndexError(f"task stream position {position} is past its end ({self.epochs} epochs of {len(self)})")
