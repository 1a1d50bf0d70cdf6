"""Built-in plugin: the ``mixture`` environment (several environments' tasks in one stream)."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.environments.mixture import MixtureOptions, MixtureSource


@hookimpl
def miles_register_environments() -> list[Component]:
    return [Component("mixture", MixtureSource, MixtureOptions,
                      "tasks of several environments in one shuffled stream (repeat weights small sets)",
                      takes_hub=True)]
