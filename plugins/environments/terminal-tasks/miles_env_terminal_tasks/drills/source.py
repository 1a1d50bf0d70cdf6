"""The ``shell-drills`` environment: unlimited seeded drills and cheap noisy demonstrations.

Task ids are ``<kind>-<index>`` with a six-digit (or longer) index, e.g. ``calc-000123``. The
instance is a pure function of the options, the seed, the kind and the index, so
``load_task(id)`` regenerates it without listing, and any index (also past ``num_tasks``) is
valid. ``list_tasks`` yields ``num_tasks`` ids, task ``i`` having kind ``kinds[i % len(kinds)]``.

Demonstrations come from their own random stream (``demonstrations(n, seed)``), so they are
fresh instances, not the listed tasks.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.environments.capabilities import EnvironmentCapabilities, capabilities_of_tasks
from miles_engine.environments.protocol import Message, TaskRef
from miles_engine.errors import UnknownComponentError

from miles_env_terminal_tasks.drills.kinds import ANSWER_KINDS, DIFFICULTY, make_instance
from miles_env_terminal_tasks.drills.options import ALL_KINDS, DrillOptions
from miles_env_terminal_tasks.drills.task import DrillTask

ID_RE = re.compile(r"^(?P<kind>[a-z-]+?)-(?P<index>\d{6,})$")


@dataclass
class Demonstration:
    """One demonstration: the task it answers and the assistant-side messages.

    ``prompt`` (system + user) followed by ``messages`` is the whole conversation; ``messages``
    are OpenAI messages (an assistant message with ``tool_calls``, the ``tool`` result exactly
    as the sandbox would print it, then the final assistant message).
    """

    task: DrillTask
    messages: list[Message]
    correct: bool
    form: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.task.kind

    @property
    def prompt(self) -> list[Message]:
        return self.task.prompt()

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools offered, in OpenAI function-calling shape (for rendering a chat template)."""
        return [tool.openai_schema() for tool in self.task.tools()]

    def conversation(self) -> list[Message]:
        return [*self.prompt, *self.messages]

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task.id, "kind": self.kind, "correct": self.correct, "form": self.form,
                "prompt": self.prompt, "messages": self.messages, "tools": self.tools}


class ShellDrillsSource:
    """Procedurally generated shell drills (see the module docstring)."""

    def __init__(self, options: DrillOptions | None = None, *, name: str = "shell-drills") -> None:
        self.options = options or DrillOptions()
        self.name = name

    # -- tasks ---------------------------------------------------------------------------
    def task_id(self, index: int) -> str:
        kinds = self.options.kinds
        return f"{kinds[index % len(kinds)]}-{index:06d}"

    def _rng(self, kind: str, index: int) -> random.Random:
        return random.Random(f"shell-drills:{self.options.seed}:{kind}:{index}")

    def make_task(self, kind: str, index: int) -> DrillTask:
        instance = make_instance(kind, self._rng(kind, index), self.options)
        return DrillTask(f"{kind}-{index:06d}", instance, self.options, source=self.name)

    def list_tasks(self) -> Iterator[TaskRef]:
        for index in range(self.options.num_tasks):
            task_id = self.task_id(index)
            kind = task_id.rsplit("-", 1)[0]
            tags = ("drill", kind, "two-turn") if kind in ANSWER_KINDS else ("drill", kind)
            yield TaskRef(id=task_id, difficulty=DIFFICULTY[kind], tags=tags, description=f"{kind} drill #{index}")

    def load_task(self, task_id: str) -> DrillTask:
        m = ID_RE.match(task_id)
        if m is None or m["kind"] not in ALL_KINDS:
            raise UnknownComponentError(
                f"unknown task '{task_id}' in environment '{self.name}': ids are '<kind>-<index>' with a "
                f"six-digit index, kind one of {', '.join(ALL_KINDS)} (e.g. 'calc-000123')"
            )
        if m["kind"] not in self.options.kinds:
            raise UnknownComponentError(
                f"task '{task_id}': kind '{m['kind']}' is not enabled in environment '{self.name}' "
                f"(kinds: {', '.join(self.options.kinds)})"
            )
        return self.make_task(m["kind"], int(m["index"]))

    def capabilities(self) -> EnvironmentCapabilities:
        """Every drill has the same sandbox and tools; one task per enabled kind covers them all."""
        return capabilities_of_tasks((self.make_task(kind, 0) for kind in self.options.kinds),
                                     reference_solution=True)

    def sample_task(self, rng: random.Random) -> DrillTask:
        """A task drawn from the unlimited id space (not only the listed ``num_tasks``)."""
        return self.make_task(rng.choice(self.options.kinds), rng.randrange(10**9))

    # -- demonstrations ------------------------------------------------------------------
    def demonstrations(self, n: int, seed: int | None = None, *, wrong_fraction: float | None = None,
                       kinds: Sequence[str] | None = None) -> Iterator[Demonstration]:
        """``n`` demonstrations on fresh instances, a share ``wrong_fraction`` (default: the
        ``demo_wrong_fraction`` option) deliberately wrong; kinds cycle round-robin."""
        frac = self.options.demo_wrong_fraction if wrong_fraction is None else wrong_fraction
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"wrong_fraction must be within [0, 1], got {frac}")
        use = list(kinds) if kinds is not None else list(self.options.kinds)
        bad = [k for k in use if k not in ALL_KINDS]
        if bad or not use:
            raise ValueError(f"unknown drill kinds {bad}; allowed: {', '.join(ALL_KINDS)}")
        rng = random.Random(f"shell-drills-demos:{self.options.seed if seed is None else seed}")
        for i in range(n):
            kind = use[i % len(use)]
            instance = make_instance(kind, rng, self.options)
            task = DrillTask(f"{kind}-demo-{i:06d}", instance, self.options, source=self.name)
            wrong = rng.random() < frac
            att = task.attempt(rng, wrong)
            yield Demonstration(task, att.messages(), not wrong, att.form, {"command": att.command})

    def __repr__(self) -> str:
        return f"ShellDrillsSource(name={self.name!r}, kinds={self.options.kinds}, seed={self.options.seed})"
