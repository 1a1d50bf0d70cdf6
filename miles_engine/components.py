"""What a plugin hook returns: named factories with an options model.

A :class:`Component` is a *registration*, not an instance. The hub keeps them in one
registry per kind; recipes name them (or give a dotted import path) and the hub builds
instances with validated options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

ComponentKind = Literal[
    "environment", "sandbox", "reward", "teacher", "agent", "chat_family", "engine", "recipe"
]
COMPONENT_KINDS: tuple[ComponentKind, ...] = (
    "environment",
    "sandbox",
    "reward",
    "teacher",
    "agent",
    "chat_family",
    "engine",
    "recipe",
)


class Section(BaseModel):
    """The base of every options model and recipe section: an unknown key is an error."""

    model_config = ConfigDict(extra="forbid")


class NoOptions(Section):
    """Options model for components that take none; any key is an error."""


@dataclass(frozen=True)
class Component:
    """A named factory registered by a plugin.

    :param name: the name recipes and the CLI use (unique per kind across all plugins).
    :param factory: called as ``factory(options)`` with a validated ``options`` instance.
    :param options: a pydantic model (``extra="forbid"``) describing the factory's options.
    :param description: one line shown by ``miles plugins``.
    :param takes_hub: call ``factory(options, hub=hub)`` with the hub that builds it (a component
        that builds others by name, e.g. the ``mixture`` environment).
    """

    name: str
    factory: Callable[..., Any]
    options: type[BaseModel] = NoOptions
    description: str = ""
    takes_hub: bool = False


@dataclass(frozen=True)
class RecipeFile:
    """A packaged recipe YAML registered through ``miles_register_recipes``."""

    name: str
    path: Path
    description: str = ""


@dataclass(frozen=True)
class Registered:
    """A component together with where it came from."""

    kind: ComponentKind
    component: Component | RecipeFile
    distribution: str
    version: str | None
    module: str
    builtin: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.component.name
