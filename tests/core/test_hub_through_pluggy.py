"""The hub collects registrations through pluggy's hook caller: MILES_TRACE_PLUGINS traces the
calls a real run makes, hook-call monitors see them, and each registration keeps its origin."""

from __future__ import annotations

import pluggy

from miles_engine import PROJECT_NAME, hookimpl, hookspecs
from miles_engine.components import Component
from miles_engine.hub import Hub, default_hub, get_plugin_manager


class _First:
    @hookimpl(tryfirst=True)
    def miles_register_engines(self):
        return [Component("first-kind", lambda o: o)]


def test_trace_switch_traces_the_hubs_own_collection(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MILES_TRACE_PLUGINS", "1")
    monkeypatch.setenv("MILES_DISABLE_PLUGIN_AUTOLOAD", "1")
    hub = Hub()
    assert "embedded" in hub.names("engine")
    err = capsys.readouterr().err
    assert "miles_register_engines" in err  # the call a training run makes, traced


def test_monitors_see_every_collection_call_and_origins_survive() -> None:
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_First(), name="first")
    seen: list[str] = []
    pm.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append(name), lambda *a: None)
    hub = Hub(pm)
    names = hub.names("engine")
    assert {"embedded", "server", "sglang", "external", "first-kind"} <= set(names)
    assert seen.count("miles_register_engines") >= 2  # one call per plugin, through the hook caller
    assert hub.get("engine", "first-kind").module == "first" or hub.get("engine", "first-kind").distribution == "first"
    assert hub.get("engine", "server").builtin


def test_one_hub_per_process_until_the_switches_change(monkeypatch) -> None:
    monkeypatch.delenv("MILES_PLUGINS", raising=False)
    a, b = default_hub(), default_hub()
    assert a is b
    monkeypatch.setenv("MILES_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert default_hub() is not a


def test_a_bare_manager_is_a_valid_hub() -> None:
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    assert Hub(pm).names("engine") == []


def test_a_command_and_what_it_builds_share_the_process_hub(monkeypatch) -> None:
    """`miles ...` builds its hub at the entry point; a mixture environment built inside it (which
    creates its member environments) and the session helpers use that same hub, not new managers."""
    import click

    from miles_engine import hub as hub_module
    from miles_engine.cli.common import cli_hub

    monkeypatch.delenv("MILES_PLUGINS", raising=False)
    monkeypatch.delenv("MILES_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(hub_module, "_DEFAULT_HUB", None)  # this process's hub is built below, once
    built: list[object] = []
    real = hub_module.get_plugin_manager
    monkeypatch.setattr(hub_module, "get_plugin_manager", lambda *a, **k: built.append(1) or real(*a, **k))
    with click.Context(click.Command("miles")):
        hub = cli_hub()
        assert cli_hub() is hub is default_hub()
        mixture = hub.create("environment", "mixture",
                             {"sources": [{"name": "terminal-tasks"}, {"name": "terminal-tasks"}]})
    assert len(mixture.sources) == 2 and len(built) == 1
