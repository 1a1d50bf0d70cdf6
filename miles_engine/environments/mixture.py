"""The ``mixture`` environment: tasks of several environments in one stream.

    environment:
      name: mixture
      options:
        sources:
          - {name: shell-drills, options: {kinds: [echo, calc]}, repeat: 1}
          - {name: terminal-tasks, options: {difficulty: [easy]}, repeat: 20}

Task ids are ``<source index>/<task id>``; ``repeat`` lists a source's tasks that many times
(weights a small task set against a large one in the shuffled stream). Demonstrations come
from the sources that have them (SFT warm start).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import Field

from miles_engine.components import Section
from miles_engine.environments.capabilities import (
    ISOLATION_ORDER,
    EnvironmentCapabilities,
    _widest,
    close_environment,
    environment_capabilities,
)
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import UnknownComponentError

if TYPE_CHECKING:
    from miles_engine.hub import Hub


class MixtureEntry(Section):
    name: str = Field(description="a registered environment")
    options: dict[str, Any] = Field(default_factory=dict, description="that environment's options")
    repeat: int = Field(1, ge=1, le=10_000, description="list this source's tasks this many times")


class MixtureOptions(Section):
    sources: list[MixtureEntry] = Field(min_length=1, description="the environments to mix")


class MixtureSource:
    name = "mixture"

    def __init__(self, options: MixtureOptions, hub: Hub) -> None:
        self.options = options
        self.sources = [hub.create("environment", e.name, e.options, where=f"environment.options.sources[{i}].options")
                        for i, e in enumerate(options.sources)]

    def list_tasks(self) -> Iterator[TaskRef]:
        for i, (entry, source) in enumerate(zip(self.options.sources, self.sources)):
            refs = list(source.list_tasks())
            for copy in range(entry.repeat):
                for ref in refs:
                    tid = f"{i}/{ref.id}" if copy == 0 else f"{i}/{ref.id}#{copy}"
                    yield ref.model_copy(update={"id": tid})

    def _split(self, task_id: str) -> tuple[Any, str]:
        index, sep, rest = task_id.partition("/")
        if not sep or not index.isdigit() or int(index) >= len(self.sources):
            raise UnknownComponentError(f"unknown task '{task_id}' in environment 'mixture': ids are "
                                        f"'<source index 0..{len(self.sources) - 1}>/<task id>'")
        return self.sources[int(index)], rest.split("#", 1)[0]

    def load_task(self, task_id: str) -> Any:
        source, inner = self._split(task_id)
        return source.load_task(inner)

    def capabilities(self) -> Any:
        """The widest of the sources' manifests."""
        caps = [environment_capabilities(s) for s in self.sources]
        return EnvironmentCapabilities(
            needs_sandbox=any(c.needs_sandbox for c in caps), image=any(c.image for c in caps),
            dockerfile_build=any(c.dockerfile_build for c in caps), network=_widest(c.network for c in caps),
            absolute_paths=any(c.absolute_paths for c in caps),
            min_isolation=max((c.min_isolation for c in caps), key=ISOLATION_ORDER.index),
            gpus=max(c.gpus for c in caps), run_as_user=any(c.run_as_user for c in caps),
            multi_turn=any(c.multi_turn for c in caps), tools=tuple(dict.fromkeys(t for c in caps for t in c.tools)),
            reference_solution=all(c.reference_solution for c in caps),
            services=tuple(dict.fromkeys(t for c in caps for t in c.services)))

    def demonstrations(self, n: int, seed: int | None = None, *, wrong_fraction: float | None = None) -> Iterator[Any]:
        with_demos = [s for s in self.sources if hasattr(s, "demonstrations")]
        if not with_demos:
            raise AttributeError("demonstrations")
        for k, source in enumerate(with_demos):
            share = n // len(with_demos) + (1 if k < n % len(with_demos) else 0)
            yield from source.demonstrations(share, seed=seed, wrong_fraction=wrong_fraction)

    async def aclose(self) -> None:
        for source in self.sources:
            await close_environment(source)
