"""The plugin hub: a pluggy manager factory and one registry per component kind.

Environment switches:

- ``MILES_DISABLE_PLUGIN_AUTOLOAD=1`` — load no entry-point plugins (built-ins only).
- ``MILES_PLUGINS=a,b`` — load only these entry points (entry-point or distribution names).
- ``MILES_TRACE_PLUGINS=1`` — print every hook call and its result to stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from miles_engine import PROJECT_NAME, __version__, hookspecs
from miles_engine.components import COMPONENT_KINDS, Component, ComponentKind, RecipeFile, Registered
from miles_engine.errors import (
    ConfigError,
    DuplicateComponentError,
    PluginError,
    did_you_mean,
    unknown_name,
)
from miles_engine.loader import load_object, looks_like_import_path

ENTRY_POINT_GROUP = "miles"
CORE_DISTRIBUTION = "miles-engine"

# Built-in plugins register through the same hooks as third-party ones.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "miles_engine.sandbox.local.plugin",
    "miles_engine.agents.plugin",
    "miles_engine.rewards.plugin",
    "miles_engine.tito.plugin",
    "miles_engine.recipes_plugin",
    "miles_engine.teachers.plugin",
    "miles_engine.engines.fleet.plugin",
    "miles_engine.environments.plugin",
)

HOOK_FOR_KIND: dict[ComponentKind, str] = {
    "environment": "miles_register_environments",
    "sandbox": "miles_register_sandboxes",
    "reward": "miles_register_rewards",
    "teacher": "miles_register_teachers",
    "agent": "miles_register_agents",
    "chat_family": "miles_register_chat_families",
    "engine": "miles_register_engines",
    "recipe": "miles_register_recipes",
}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _selected_entry_points() -> list[EntryPoint]:
    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    wanted_raw = os.environ.get("MILES_PLUGINS", "").strip()
    if not wanted_raw:
        return eps
    wanted = [w.strip() for w in wanted_raw.split(",") if w.strip()]
    known = {ep.name for ep in eps} | {ep.dist.name for ep in eps if ep.dist is not None}
    for w in wanted:
        if w not in known:
            raise PluginError(
                f"MILES_PLUGINS names '{w}'{did_you_mean(w, known)}, which is not an installed "
                f"'{ENTRY_POINT_GROUP}' entry point; installed: {', '.join(sorted(known)) or 'none'}"
            )
    return [ep for ep in eps if ep.name in wanted or (ep.dist is not None and ep.dist.name in wanted)]


def get_plugin_manager(load_entrypoints: bool | None = None) -> pluggy.PluginManager:
    """Build a plugin manager with the specs, the built-ins and (optionally) entry points.

    :param load_entrypoints: override ``MILES_DISABLE_PLUGIN_AUTOLOAD``; ``None`` reads it.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    origins: dict[str, tuple[str, str | None, bool]] = {}
    for module_name in DEFAULT_PLUGINS:
        pm.register(import_module(module_name), name=module_name)
        origins[module_name] = (CORE_DISTRIBUTION, __version__, True)
    if load_entrypoints is None:
        load_entrypoints = not _env_flag("MILES_DISABLE_PLUGIN_AUTOLOAD")
    if load_entrypoints:
        for ep in _selected_entry_points():
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            version = ep.dist.version if ep.dist is not None else None
            if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must name itself
                raise PluginError(
                    f"cannot load plugin '{ep.name}' ({ep.value}) from distribution '{dist}': "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            pm.register(plugin, name=ep.name)
            origins[ep.name] = (dist, version, False)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) or repr(exc.plugin)
        dist = origins.get(name, ("?",))[0]
        raise PluginError(
            f"plugin '{name}' from '{dist}' implements a hook that does not exist: {exc}. "
            f"Valid hooks: {', '.join(sorted(HOOK_FOR_KIND.values()))}"
        ) from exc
    pm.miles_origins = origins  # type: ignore[attr-defined]
    if _env_flag("MILES_TRACE_PLUGINS"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    return pm


class Hub:
    """Registries of components by kind, built lazily from a plugin manager."""

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.pm = pm if pm is not None else get_plugin_manager()
        self._registries: dict[ComponentKind, dict[str, Registered]] = {}

    def registry(self, kind: ComponentKind) -> dict[str, Registered]:
        if kind not in self._registries:
            self._registries[kind] = self._collect(kind)
        return self._registries[kind]

    def _collect(self, kind: ComponentKind) -> dict[str, Registered]:
        """Call each plugin's implementation through pluggy's hook caller (so tracing, hook-call
        monitoring and wrappers apply), one plugin at a time so every registration keeps its origin."""
        origins: dict[str, tuple[str, str | None, bool]] = getattr(self.pm, "miles_origins", {})
        hook_name = HOOK_FOR_KIND[kind]
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        wrappers = {id(i.plugin) for i in impls if i.hookwrapper or getattr(i, "wrapper", False)}
        plain = [i for i in impls if id(i.plugin) not in wrappers]
        found: dict[str, Registered] = {}
        for impl in reversed(plain):  # pluggy's call order: last registered first, tryfirst/trylast honoured
            plugin_name = impl.plugin_name
            dist, version, builtin = origins.get(plugin_name, (plugin_name, None, False))
            others = [i.plugin for i in plain if i.plugin is not impl.plugin]
            results = self.pm.subset_hook_caller(hook_name, remove_plugins=others)()
            items = [item for result in results for item in (result or [])]
            expected = RecipeFile if kind == "recipe" else Component
            for item in items:
                if not isinstance(item, expected):
                    raise PluginError(
                        f"plugin '{plugin_name}' ({dist}) returned {type(item).__name__} from "
                        f"{hook_name}; expected {expected.__name__}"
                    )
                if item.name in found:
                    other = found[item.name]
                    raise DuplicateComponentError(
                        f"{kind} name '{item.name}' is registered twice: by distribution "
                        f"'{other.distribution}' (plugin '{other.module}') and by '{dist}' "
                        f"(plugin '{plugin_name}'); uninstall one or disable it with MILES_PLUGINS"
                    )
                module = getattr(impl.plugin, "__name__", plugin_name)
                found[item.name] = Registered(kind, item, dist, version, module, builtin)
        return found

    def all(self) -> list[Registered]:
        return [reg for kind in COMPONENT_KINDS for reg in self.registry(kind).values()]

    def names(self, kind: ComponentKind) -> list[str]:
        return sorted(self.registry(kind))

    def get(self, kind: ComponentKind, name: str) -> Registered:
        reg = self.registry(kind).get(name)
        if reg is None:
            raise unknown_name(kind.replace("_", " "), name, self.registry(kind))
        return reg

    def component(self, kind: ComponentKind, ref: str) -> Component:
        """Resolve a registered name, or a dotted import path to a Component or factory."""
        if ref in self.registry(kind) or not looks_like_import_path(ref):
            comp = self.get(kind, ref).component
            assert isinstance(comp, Component)
            return comp
        obj = load_object(ref)
        if isinstance(obj, Component):
            return obj
        if callable(obj):
            options = getattr(obj, "options_model", None)
            return Component(name=ref, factory=obj, **({"options": options} if options else {}))
        raise ConfigError(f"'{ref}' is neither a registered {kind} nor a Component/callable")

    def create(
        self,
        kind: ComponentKind,
        ref: str,
        options: Mapping[str, Any] | BaseModel | None = None,
        *,
        where: str = "",
    ) -> Any:
        """Build a component with validated options; errors name ``where`` (e.g. a recipe key)."""
        comp = self.component(kind, ref)
        validated = validate_options(comp, options, where=where or f"{kind} '{ref}'")
        return comp.factory(validated, hub=self) if comp.takes_hub else comp.factory(validated)


_DEFAULT_HUB: tuple[tuple[Any, ...], Hub] | None = None


def default_hub() -> Hub:
    """The process's hub, built once (entry points load once per process) and rebuilt only when
    the plugin switches (``MILES_*`` environment, built-in list) change."""
    global _DEFAULT_HUB
    key = (DEFAULT_PLUGINS, *(os.environ.get(v) for v in ("MILES_DISABLE_PLUGIN_AUTOLOAD", "MILES_PLUGINS",
                                                          "MILES_TRACE_PLUGINS")))
    if _DEFAULT_HUB is None or _DEFAULT_HUB[0] != key:
        _DEFAULT_HUB = (key, Hub())
    return _DEFAULT_HUB[1]


def validate_options(comp: Component, options: Mapping[str, Any] | BaseModel | None, *, where: str) -> BaseModel:
    if isinstance(options, comp.options):
        return options
    raw = dict(options or {}) if not isinstance(options, BaseModel) else options.model_dump()
    try:
        return comp.options.model_validate(raw)
    except ValidationError as exc:
        from miles_engine.errors import format_validation_error

        raise ConfigError(format_validation_error(exc, prefix=where, model=comp.options)) from exc


def iter_registrations(hub: Hub, *, include_builtin: bool) -> Iterable[Registered]:
    return (r for r in hub.all() if include_builtin or not r.builtin)
