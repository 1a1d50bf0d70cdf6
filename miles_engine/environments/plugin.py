"""Built-in plugin: the ``mixture`` environment (several environments' tasks in one stream)."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component


def _mixture(opts):  # type: ignore[no-untyped-def]
    from miles_engine.environments.mixture import MixtureSource

    return MixtureSource(opts)


@hookimpl
def miles_register_environments() -> list[Component]:
    from miles_engine.environments.mixture import MixtureOptions

    return [Component("mixture", _mixture, MixtureOptions,
                      "tasks of several environments in one shuffled stream (repeat weights small sets)")]
