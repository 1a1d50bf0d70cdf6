"""The plugin hub: discovery, built-ins, duplicates, switches, typos, dotted paths."""

from __future__ import annotations

import pytest

from miles_engine.components import Component
from miles_engine.errors import ConfigError, DuplicateComponentError, PluginError, UnknownComponentError
from miles_engine.hub import Hub, get_plugin_manager

ENV_PLUGIN = """
from pydantic import BaseModel, ConfigDict
from miles_engine import hookimpl
from miles_engine.components import Component

class Opts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 3

class Source:
    def __init__(self, opts):
        self.name = "{name}"
        self.opts = opts

@hookimpl
def miles_register_environments():
    return [Component("{name}", Source, options=Opts, description="a test environment")]
"""


def add_env_plugin(fake_dists, dist: str, module: str, env_name: str, version: str = "1.2.3") -> None:
    fake_dists.add(dist, version, {module: module}, {module: ENV_PLUGIN.format(name=env_name)})


def test_builtins_register_like_plugins():
    hub = Hub(get_plugin_manager(load_entrypoints=False))
    local = hub.get("sandbox", "local")
    assert local.builtin and local.distribution == "miles-engine"
    assert {"oracle", "nop"} <= set(hub.names("agent"))
    assert "terminal-tasks-oracle" in hub.names("recipe")


def test_entry_point_plugin_is_discovered_with_its_distribution(fake_dists):
    add_env_plugin(fake_dists, "miles-env-demo", "demo_plugin", "demo")
    reg = Hub().get("environment", "demo")
    assert (reg.distribution, reg.version, reg.builtin) == ("miles-env-demo", "1.2.3", False)
    assert reg.module == "demo_plugin"


def test_create_validates_options(fake_dists):
    add_env_plugin(fake_dists, "miles-env-demo", "demo_plugin", "demo")
    hub = Hub()
    assert hub.create("environment", "demo", {"size": 5}).opts.size == 5
    with pytest.raises(ConfigError) as err:
        hub.create("environment", "demo", {"sise": 5}, where="environment.options")
    msg = str(err.value)
    assert "environment.options.sise" in msg and "did you mean 'size'" in msg


def test_duplicate_name_names_both_distributions(fake_dists):
    add_env_plugin(fake_dists, "miles-env-one", "one_plugin", "twin")
    add_env_plugin(fake_dists, "miles-env-two", "two_plugin", "twin")
    with pytest.raises(DuplicateComponentError) as err:
        Hub().registry("environment")
    assert "miles-env-one" in str(err.value) and "miles-env-two" in str(err.value) and "'twin'" in str(err.value)


def test_unknown_name_lists_available_with_suggestion():
    with pytest.raises(UnknownComponentError) as err:
        Hub().get("agent", "oracel")
    msg = str(err.value)
    assert "did you mean 'oracle'" in msg and "nop" in msg


def test_hook_name_typo_fails_loudly(fake_dists):
    fake_dists.add("miles-typo", "0.1", {"typo": "typo_plugin"}, {"typo_plugin": """
        from miles_engine import hookimpl
        @hookimpl
        def miles_register_enviroments():
            return []
    """})
    with pytest.raises(PluginError) as err:
        get_plugin_manager()
    assert "typo" in str(err.value) and "miles_register_environments" in str(err.value)


def test_broken_plugin_names_itself(fake_dists):
    fake_dists.add("miles-broken", "0.1", {"broken": "broken_plugin"}, {"broken_plugin": "raise RuntimeError('boom')"})
    with pytest.raises(PluginError, match="miles-broken.*boom"):
        get_plugin_manager()


def test_wrong_registration_type_is_an_error(fake_dists):
    fake_dists.add("miles-wrong", "0.1", {"wrong": "wrong_plugin"}, {"wrong_plugin": """
        from miles_engine import hookimpl
        @hookimpl
        def miles_register_agents():
            return ["not a component"]
    """})
    with pytest.raises(PluginError, match="expected Component"):
        Hub().registry("agent")


def test_disable_autoload(fake_dists, monkeypatch):
    add_env_plugin(fake_dists, "miles-env-demo", "demo_plugin", "demo")
    monkeypatch.setenv("MILES_DISABLE_PLUGIN_AUTOLOAD", "1")
    hub = Hub()
    assert "demo" not in hub.names("environment")
    assert "local" in hub.names("sandbox")  # built-ins stay


def test_load_only_named_plugins(fake_dists, monkeypatch):
    add_env_plugin(fake_dists, "miles-env-one", "one_plugin", "one")
    add_env_plugin(fake_dists, "miles-env-two", "two_plugin", "two")
    monkeypatch.setenv("MILES_PLUGINS", "miles-env-two")  # by distribution name
    names = Hub().names("environment")
    assert "two" in names and "one" not in names
    monkeypatch.setenv("MILES_PLUGINS", "one_plugin")  # by entry-point name
    names = Hub().names("environment")
    assert "one" in names and "two" not in names
    monkeypatch.setenv("MILES_PLUGINS", "miles-env-tow")
    with pytest.raises(PluginError, match="did you mean 'miles-env-two'"):
        get_plugin_manager()


def test_trace_plugins_prints_hook_calls(fake_dists, monkeypatch, capsys):
    monkeypatch.setenv("MILES_TRACE_PLUGINS", "1")
    Hub().registry("agent")
    Hub().pm.hook.miles_register_agents()
    assert "miles_register_agents" in capsys.readouterr().err


def test_dotted_path_component(fake_dists):
    fake_dists.add("miles-dotted", "0.1", {}, {"dotted_agents": """
        class Echo:
            name = "echo"
            def __init__(self, opts):
                self.opts = opts
        def make_echo(opts):
            return Echo(opts)
    """})
    hub = Hub()
    comp = hub.component("agent", "dotted_agents:make_echo")
    assert isinstance(comp, Component)
    assert hub.create("agent", "dotted_agents.make_echo").name == "echo"
    assert isinstance(hub.component("agent", "miles_engine.agents.plugin:miles_register_agents"), Component)
    with pytest.raises(ConfigError, match="cannot import module"):
        hub.component("agent", "no_such_module.thing:Agent")
    with pytest.raises(ConfigError, match="has no attribute"):
        hub.component("agent", "dotted_agents:nothing")
