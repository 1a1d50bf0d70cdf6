"""What the trainer reports per trajectory of an RL step, for the run's trajectory record: the
advantage each row trained with and, for the rows the driver asked for, the trainer's own
log-probs of the row's tokens."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from miles_engine.rollout.types import Group

if TYPE_CHECKING:
    from torch import Tensor

Key = tuple[str, int]
ROWS_KEY = "_trajectory_rows"  # in the step's result: popped by the driver, never logged


def row_keys(minibatches: Sequence[Sequence[Group]]) -> list[Key]:
    """(group_id, index) of each batch row, in ``from_groups`` order."""
    return [(t.group_id or g.group_id, int(t.index)) for groups in minibatches for g in groups for t in g.trajectories]


def step_rows(keys: Sequence[Key], lengths: Sequence[int], advantages: Tensor | None, trainer_logp: Tensor | None,
              record: Collection[Key]) -> dict[Key, dict[str, Any]]:
    adv = advantages.tolist() if advantages is not None else [None] * len(keys)
    out: dict[Key, dict[str, Any]] = {}
    for i, key in enumerate(keys):
        row: dict[str, Any] = {"advantage": adv[i]}
        if trainer_logp is not None and key in record:
            n = lengths[i]
            row["trainer_logprobs"] = trainer_logp[i, :n].tolist()  # the recorder zeroes them off the loss mask
        out[key] = row
    return out
