"""Multi-teacher routing: each sample goes to the teacher named by one of its tags.

``route_tag`` names the trajectory tag to read (e.g. ``kind``); ``routes`` maps a tag value to
a teacher name; ``default`` catches everything else. A sample with no route and no default is
an error that names the tag, its value and the routes there are: never a silent skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from miles_engine.errors import ConfigError, MilesError

T = TypeVar("T")


class TeacherRoutingError(MilesError):
    """A sample matched no route and there is no default teacher."""


class TeacherRouter(Generic[T]):
    def __init__(self, teachers: Mapping[str, T], *, route_tag: str | None = None,
                 routes: Mapping[str, str] | None = None, default: str | None = None) -> None:
        if not teachers:
            raise ConfigError("opd.teachers is empty: name at least one teacher")
        routes = dict(routes or {})
        for value, name in routes.items():
            if name not in teachers:
                raise ConfigError(f"opd.routes.{value} names teacher '{name}', which is not in opd.teachers "
                                  f"({', '.join(sorted(teachers))})")
        if default is not None and default not in teachers:
            raise ConfigError(f"opd.default names teacher '{default}', which is not in opd.teachers "
                              f"({', '.join(sorted(teachers))})")
        if routes and not route_tag:
            raise ConfigError("opd.routes is set but opd.route_tag is not: name the sample tag to route on")
        if default is None and not routes:
            if len(teachers) != 1:
                raise ConfigError(f"opd.teachers has {len(teachers)} teachers but neither opd.routes nor opd.default: "
                                  f"say which sample goes to which teacher")
            default = next(iter(teachers))
        self.teachers = dict(teachers)
        self.route_tag, self.routes, self.default = route_tag, routes, default

    def name_for(self, tags: Mapping[str, str], *, sample: str = "sample") -> str:
        value = tags.get(self.route_tag) if self.route_tag else None
        if value is not None and value in self.routes:
            return self.routes[value]
        if self.default is not None:
            return self.default
        shown = f"tag {self.route_tag}={value!r}" if value is not None else f"no tag {self.route_tag!r}"
        raise TeacherRoutingError(f"{sample} has {shown}, which matches no route in opd.routes "
                                  f"({', '.join(sorted(self.routes)) or 'none'}) and opd.default is unset")

    def route(self, tags: Mapping[str, str], *, sample: str = "sample") -> T:
        return self.teachers[self.name_for(tags, sample=sample)]
