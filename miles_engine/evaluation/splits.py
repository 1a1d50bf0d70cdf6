"""Held-out task splits: which tasks train and which evaluate, deterministically.

``hash``: a task is held out when ``sha256(salt:task_id)`` read as a fraction of 2**64 is below
``fraction``. It depends on the id and the salt only (not on the listing order, the number of
tasks, the process or the Python version), so a split is the same in every run and a task keeps
its side when tasks are added. ``source``: the environment's own split: its
``task_split(task_id) -> "train" | "eval" | None`` (``None``: train).

A task is never in both: :func:`check_disjoint` refuses an eval task set that shares ids with
the training tasks, with one error naming some of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from miles_engine.checkpoint.compat import flatten
from miles_engine.environments.admission import ExcludedTask, admit_on
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import ConfigError
from miles_engine.evaluation.config import EvalConfig

Side = Literal["train", "eval"]
_EVAL_LABELS = frozenset({"eval", "test", "validation", "valid", "held_out", "heldout"})


def hash_fraction(task_id: str, salt: str) -> float:
    digest = hashlib.sha256(f"{salt}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def source_side(source: Any, task_id: str) -> Side:
    label = source.task_split(task_id)
    return "eval" if label is not None and str(label).lower() in _EVAL_LABELS else "train"


def side_of(task_id: str, cfg: EvalConfig, source: Any) -> Side | None:
    """The task's side under ``cfg``'s split (``None``: no split in effect)."""
    method = cfg.split_method
    if method == "none":
        return None
    if method == "hash":
        return "eval" if hash_fraction(task_id, cfg.split.salt) < cfg.split.fraction else "train"
    return source_side(source, task_id)


def _check_source_split(cfg: EvalConfig, source: Any) -> None:
    if cfg.split_method == "source" and not callable(getattr(source, "task_split", None)):
        raise ConfigError(f"eval.split.by: 'source' but environment '{getattr(source, 'name', source)}' declares no "
                          f"split of its own (it has no task_split method); use eval.split.by: hash")


def splits_training_environment(cfg: EvalConfig) -> bool:
    """Whether the training task stream must leave the held-out tasks out."""
    return cfg.environment is None and cfg.split_method != "none"


def train_filter(cfg: EvalConfig, source: Any) -> Callable[[TaskRef], bool] | None:
    """The training stream's ``task_filter``: keep train-side tasks (``None``: no split)."""
    if not splits_training_environment(cfg):
        return None
    _check_source_split(cfg, source)
    return lambda ref: side_of(ref.id, cfg, source) == "train"


@dataclass
class EvalTasks:
    """The eval task set: its source, its ids, and how it was chosen."""

    source: Any
    ids: list[str]
    split: str  # "hash(fraction=0.1, salt=...)", "source", "none", "environment <name>"
    listed: int  # ids considered before the split / limit
    excluded: list[ExcludedTask] = field(default_factory=list)  # chosen, but the sandbox backend cannot run them

    def describe(self) -> str:
        left_out = f"; {len(self.excluded)} excluded (the sandbox backend cannot run them)" if self.excluded else ""
        return (f"{len(self.ids)} eval task(s) of environment '{getattr(self.source, 'name', '?')}' "
                f"({self.split}){left_out}")


def runnable_eval_tasks(tasks: EvalTasks, backend_name: str | None, backend: Any) -> EvalTasks:
    """``tasks`` less those ``backend`` cannot run (each kept with its reason in ``excluded``);
    one error naming every reason when none is left."""
    admission = admit_on(tasks.source, backend_name, backend, task_ids=tasks.ids)
    if admission.excluded:
        print(f"eval: {admission.report()}", flush=True)
    admission.require_some("to evaluate")
    return replace(tasks, ids=[t for t in tasks.ids if t not in admission.excluded_ids],
                   excluded=list(admission.excluded))


def select_eval_tasks(cfg: EvalConfig, source: Any, *, from_training_env: bool) -> EvalTasks:
    """``cfg.tasks`` or the eval side of the listing (when the split applies), first ``limit``."""
    refs = list(source.list_tasks())
    method = cfg.split_method if from_training_env else "none"
    if cfg.tasks is not None:
        known = {r.id for r in refs}
        missing = [t for t in cfg.tasks if t not in known]
        if missing:
            raise ConfigError(f"eval.tasks: environment '{source.name}' has no task(s) "
                              f"{', '.join(map(repr, missing[:5]))} (it lists {len(refs)} tasks)")
        ids = list(cfg.tasks)
    elif method == "none":
        ids = [r.id for r in refs]
    else:
        _check_source_split(cfg, source)
        ids = [r.id for r in refs if side_of(r.id, cfg, source) == "eval"]
        if not ids:
            raise ConfigError(f"eval.split: environment '{source.name}' lists {len(refs)} tasks and none is held out "
                              f"for evaluation (by: {method}); raise eval.split.fraction or change the split")
    if cfg.limit:
        ids = ids[: cfg.limit]
    if not ids:
        raise ConfigError(f"eval: environment '{source.name}' gives no task to evaluate")
    label = {"hash": f"hash split, fraction {cfg.split.fraction:g}, salt {cfg.split.salt!r}",
             "source": "the environment's own split", "none": "no split"}[method]
    if not from_training_env:
        label = "an eval environment of its own"
    return EvalTasks(source, ids, label, len(refs))


def check_disjoint(train_ids: Iterable[str], eval_ids: Sequence[str], *, environment: str,
                   what: str = "training tasks") -> None:
    """One clear error when any eval task is also a training task (``what``: which ones)."""
    both = sorted(set(eval_ids) & set(train_ids))
    if both:
        shown = ", ".join(map(repr, both[:5])) + (f", … ({len(both) - 5} more)" if len(both) > 5 else "")
        raise ConfigError(f"eval: {len(both)} of the {len(eval_ids)} eval task(s) are also {what} of "
                          f"environment '{environment}': {shown}. Held-out evaluation needs disjoint tasks: set "
                          f"eval.split.by: hash (or source), or evaluate another environment (eval.environment)")


# ---------------------------------------------------------------------- on resume
def training_split(eval_section: Any) -> str:
    """What the training task stream leaves out for evaluation, as one comparable line."""
    if isinstance(eval_section, EvalConfig):
        cfg = eval_section
    else:  # a checkpoint's recipe: keys of other versions are not about the split
        known = {k: v for k, v in (eval_section or {}).items() if k in ("environment", "every", "split")}
        cfg = EvalConfig.model_validate(known)
    if cfg.environment is not None:
        return f"nothing held out (eval runs on environment {cfg.environment.name!r})"
    method = cfg.split_method
    if method == "hash":
        return f"hash split, fraction {cfg.split.fraction:g}, salt {cfg.split.salt!r}"
    if method == "source":
        return "the environment's own split"
    return "nothing held out (no split)"


_NOTHING = "nothing held out"
_SPLIT_KEYS = ("eval.environment", "eval.every", "eval.split")


def resume_split_change(old_config: dict[str, Any], new_config: dict[str, Any]) -> str | None:
    """Why a checkpoint written under ``old_config`` cannot resume under ``new_config`` because the
    train / eval split of its tasks would change (``None``: it would not). A changed split moves
    tasks across the line: trained tasks would be evaluated as held-out ones, or held-out ones
    trained (``eval.split.by: auto`` follows ``eval.every``, so turning evaluation on or off
    changes it too)."""
    old_eval, new_eval = old_config.get("eval") or {}, new_config.get("eval") or {}
    before, now = training_split(old_eval), training_split(new_eval)
    if before == now or (before.startswith(_NOTHING) and now.startswith(_NOTHING)):
        return None
    flat_old, flat_new = flatten({"eval": old_eval}), flatten({"eval": new_eval})
    missing = "<absent>"
    keys = sorted(k for k in set(flat_old) | set(flat_new) if k.startswith(_SPLIT_KEYS)
                  and flat_old.get(k, missing) != flat_new.get(k, missing))
    lines = [f"  {k}: checkpoint {flat_old.get(k, missing)!r}, now {flat_new.get(k, missing)!r}" for k in keys]
    return (f"the train / eval split of the training environment's tasks would change: the checkpoint trained "
            f"with {before}, this recipe with {now}\n" + "\n".join(lines) +
            "\na changed split would evaluate tasks the model was trained on (or train held-out ones); keep "
            "eval.every, eval.split and eval.environment as the checkpoint had them (eval.every may change "
            "while eval.split.by is set explicitly), or start a new run")
