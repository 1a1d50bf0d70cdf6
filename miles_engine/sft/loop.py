"""What every SFT on demonstrations shares (the run's warm start, the start-up teacher): the rows,
the step count, the batch order, and when to stop."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from miles_engine.tito.rows import conversation_row
from miles_engine.trainer.rows import SFTRow


def demo_rows(codec: Any, demos: Iterable[Any]) -> list[Any]:
    """Demonstrations as exact token rows (``SFTRow``), laid out as the session server lays out RL rows."""
    return [SFTRow(*conversation_row(codec, d.prompt, d.messages, d.tools)) for d in demos]


def step_count(rows: int, *, epochs: float, batch_size: int) -> int:
    return max(1, math.ceil(rows * epochs / batch_size))


def shuffled_batches(rows: int, *, batch_size: int, steps: int, seed: int) -> Iterator[tuple[int, list[int]]]:
    """``(step, row indices)`` for steps 1..``steps``: a fresh shuffle of every row is appended to the
    order whenever less than a batch is left, so epochs run into each other (fixed by ``seed``)."""
    rng = random.Random(seed)
    order: list[int] = []
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            fresh = list(range(rows))
            rng.shuffle(fresh)
            order += fresh
        batch, order = order[:batch_size], order[batch_size:]
        yield step, batch


def stopper(stop: Callable[[], bool], max_minutes: float | None) -> Callable[[], bool]:
    """True once ``stop()`` is, or ``max_minutes`` have passed since this call."""
    started = time.monotonic()
    return lambda: stop() or (max_minutes is not None and time.monotonic() - started > max_minutes * 60)
