"""The ``dataset`` environment: one task per row of a local data file.

Rows are read once, at construction, through Hugging Face ``datasets`` (JSONL / Parquet /
Arrow / CSV files, ``save_to_disk`` directories, local dataset repositories; ``streaming``
reads them without building datasets' Arrow cache). Each row is validated against the field
mapping then, so a bad row stops the run before anything starts, with one line naming the
file, the row and the field (``skip_bad_rows``: counted in ``bad_rows`` and reported).

The split is deterministic: a task is on the eval side when the sha256 of its id (salted with
``split_by.seed``) falls under ``split_by.eval_fraction``, or, with ``split_by.eval_split``, the
source's own named splits are used (and checked disjoint). The listing order is the file's, or
a seeded shuffle (``shuffle_seed``); the rollout task stream (``rollout.task_seed``) shuffles per
epoch on top and its checkpointed cursor resumes the order exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.data.errors import BadRows, DataError
from miles_engine.data.files import open_rows
from miles_engine.data.splits import check_disjoint, in_eval
from miles_engine.environments.capabilities import EnvironmentCapabilities, capabilities_of_tasks
from miles_engine.environments.protocol import Message, TaskRef
from miles_engine.errors import UnknownComponentError

from miles_env_dataset.fields import TaskSpec, row_to_spec
from miles_env_dataset.generators import write_generated
from miles_env_dataset.options import DatasetEnvOptions
from miles_env_dataset.task import DatasetTask


@dataclass
class Demonstration:
    """A reference answer as the assistant turn (SFT warm start and tokenizer corpus)."""

    task: DatasetTask
    messages: list[Message]
    correct: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> list[Message]:
        return self.task.prompt()

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [t.openai_schema() for t in self.task.tools()]

    def conversation(self) -> list[Message]:
        return [*self.prompt, *self.messages]


class DatasetSource:
    def __init__(self, options: DatasetEnvOptions, *, name: str = "dataset") -> None:
        self.options, self.name = options, name
        self.file = str(options.resolved)
        if options.generate is not None:
            write_generated(options.resolved, options.generate)
        self.bad_rows = BadRows(self.file)
        specs = self._side()
        if options.shuffle_seed is not None:
            random.Random(options.shuffle_seed).shuffle(specs)
        self.specs = specs[:options.limit] if options.limit else specs
        self.by_id = {s.id: s for s in self.specs}
        if self.bad_rows.count:
            print(self.bad_rows.summary())

    def _read(self, split: str) -> list[TaskSpec]:
        o = self.options
        specs: list[TaskSpec] = []
        first_row: dict[str, int] = {}
        for number, row in open_rows(o, split):
            try:
                spec = row_to_spec(row, o.fields, self.file, number, o.system_prompt)
                if spec.id in first_row:
                    raise DataError(self.file, f"task id {spec.id!r} is also row {first_row[spec.id]}'s; ids must "
                                    f"be unique", row=number, field=o.fields.task_id or "task_id")
            except DataError as exc:
                if not o.skip_bad_rows:
                    raise
                self.bad_rows.add(exc)
                continue
            first_row[spec.id] = number
            specs.append(spec)
        return specs

    def _side(self) -> list[TaskSpec]:
        o, split = self.options, self.options.split_by
        if split.eval_split is not None:
            train = self._read(o.split)
            held = self._read(split.eval_split)
            check_disjoint([s.id for s in train], [s.id for s in held], self.file)
            return {"train": train, "eval": held, "all": [*train, *held]}[split.use]
        rows = self._read(o.split)
        if split.use == "all" or not split.eval_fraction:
            return rows
        want_eval = split.use == "eval"
        return [s for s in rows if in_eval(s.id, split) == want_eval]

    # -- the environment protocol ---------------------------------------------------------
    def list_tasks(self) -> Iterator[TaskRef]:
        for s in self.specs:
            kind = "sandboxed" if s.sandboxed else "single-turn"
            yield TaskRef(id=s.id, tags=("dataset", kind), description=f"row {s.row} of {self.file}")

    def load_task(self, task_id: str) -> DatasetTask:
        spec = self.by_id.get(task_id)
        if spec is None:
            raise UnknownComponentError(f"unknown task '{task_id}' in environment '{self.name}' ({len(self.specs)} "
                                        f"tasks from {self.file}, split side '{self.options.split_by.use}')")
        return DatasetTask(spec, self.options, self.name)

    def capabilities(self) -> EnvironmentCapabilities:
        kinds: dict[tuple[bool, str | None], TaskSpec] = {}
        for s in self.specs:
            kinds.setdefault((s.sandboxed, s.image), s)
        tasks = [DatasetTask(s, self.options, self.name) for s in kinds.values()]
        return capabilities_of_tasks(tasks, reference_solution=all(s.answer is not None for s in self.specs))

    # -- demonstrations (rows with a reference answer) -------------------------------------
    def demonstrations(self, n: int, seed: int | None = None, *, wrong_fraction: float | None = None,
                       kinds: Sequence[str] | None = None) -> Iterator[Demonstration]:
        """``n`` single-turn demonstrations drawn from the listed rows with an answer; a share
        ``wrong_fraction`` (default ``demo_wrong_fraction``) answered off by 1..3 (numeric answers)."""
        frac = self.options.demo_wrong_fraction if wrong_fraction is None else wrong_fraction
        usable = [s for s in self.specs if s.answer is not None]
        if not usable:
            raise DataError(self.file, "has no row with a reference answer: no demonstrations to warm start on",
                            field=self.options.fields.answer or "answer")
        rng = random.Random(f"dataset-demos:{seed or 0}")
        for _ in range(n):
            spec = rng.choice(usable)
            answer, wrong = spec.answer, rng.random() < frac
            if wrong and isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = answer + rng.choice((-3, -2, -1, 1, 2, 3))
            else:
                wrong = False
            task = DatasetTask(spec, self.options, self.name)
            yield Demonstration(task, [{"role": "assistant", "content": str(answer)}], not wrong)

    def __repr__(self) -> str:
        return f"DatasetSource(name={self.name!r}, file={self.file!r}, tasks={len(self.specs)})"
