"""Deterministic train/eval splits: by a hash of the task id (stable under row order, file format
and additions of other rows), or by the source's own named splits."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.data.errors import DataError


class SplitOptions(Section):
    use: Literal["train", "eval", "all"] = Field("train", description="which side of the split this source serves")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="share of task ids hashed into the eval side "
                                 "(ignored when eval_split names a split of the source)")
    eval_split: str | None = Field(None, description="the source's own eval split (e.g. 'test'): train rows come "
                                   "from `split`, eval rows from this one; ids must not overlap")
    seed: int = Field(0, description="salt of the id hash: another seed draws another eval set")


def hash_fraction(task_id: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by the id and the seed (sha256, not Python's salted hash)."""
    digest = hashlib.sha256(f"{seed}\x00{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def in_eval(task_id: str, options: SplitOptions) -> bool:
    return options.eval_fraction > 0 and hash_fraction(task_id, options.seed) < options.eval_fraction


def check_disjoint(train_ids: Iterable[str], eval_ids: Iterable[str], file: str) -> None:
    overlap = sorted(set(train_ids) & set(eval_ids))
    if overlap:
        raise DataError(file, f"{len(overlap)} task id(s) are in both the train and the eval split "
                        f"(e.g. {', '.join(map(repr, overlap[:3]))}): the splits must be disjoint", field="task_id")
