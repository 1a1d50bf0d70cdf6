"""``miles tito check`` and the built-in plugin's registrations."""

from __future__ import annotations

import json

import pluggy
import pytest
from click.testing import CliRunner

import miles_engine.hub as hub_module
from miles_engine import PROJECT_NAME, hookspecs
from miles_engine.cli.tito_cmd import tito
from miles_engine.hub import Hub
from miles_engine.tito import plugin as tito_plugin
from miles_engine.tito.conversations import builtin_conversations

from .conftest import QWEN_SPEC


@pytest.fixture(autouse=True)
def _with_tito_plugin(monkeypatch):
    if "miles_engine.tito.plugin" not in hub_module.DEFAULT_PLUGINS:
        monkeypatch.setattr(hub_module, "DEFAULT_PLUGINS", (*hub_module.DEFAULT_PLUGINS, "miles_engine.tito.plugin"))
    monkeypatch.setenv("MILES_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_plugin_registers_families_and_agents():
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(tito_plugin, name="miles_engine.tito.plugin")
    hub = Hub(pm)
    assert hub.names("chat_family") == ["chatml", "glm", "qwen3", "template"]
    assert hub.names("agent") == ["harness", "tito", "tito-external"]
    family = hub.create("chat_family", "qwen3", {"enable_thinking": False})
    assert family.template_kwargs["enable_thinking"] is False
    from miles_engine.errors import ConfigError

    with pytest.raises(ConfigError, match="enable_thinkng"):
        hub.create("chat_family", "glm", {"enable_thinkng": True})
    agent = hub.create("agent", "tito", {"server_url": "http://127.0.0.1:1", "max_turns": 3})
    assert agent.name == "tito"


def _invoke(*args: str):
    return CliRunner().invoke(tito, list(args), catch_exceptions=False)


@pytest.mark.parametrize("family,tokenizer", [("qwen3", QWEN_SPEC), ("glm", "builtin:bpe-glm"),
                                              ("chatml", "builtin:bpe-chatml")])
def test_check_passes_for_builtin_families(family, tokenizer):
    result = _invoke("check", "--family", family, "--tokenizer", tokenizer, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["passed"]
    checks = {f["check"] for f in report["findings"]}
    assert {"append_only", "incremental", "parse", "engine"} <= checks


def test_check_fails_a_non_append_only_template_naming_the_token(qwen_tokenizer):
    result = _invoke("check", "--family", "tests.tito.legacy_family:legacy_qwen3_family",
                     "--tokenizer", "builtin:qwen3", "--json", "--engine", "none")
    assert result.exit_code == 1
    report = json.loads(result.output)
    bad = [f for f in report["findings"] if not f["ok"]]
    assert bad[0]["check"] == "append_only"
    assert "first differing token at index" in bad[0]["message"] and "<think>" in bad[0]["message"]


def test_check_reads_a_conversations_file(tmp_path):
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in builtin_conversations()[:2]))
    result = _invoke("check", "--family", "chatml", "--tokenizer", "builtin:bpe-chatml",
                     "--conversations", str(path), "--engine", "none")
    assert result.exit_code == 0, result.output
    assert "passed" in result.output


def test_check_end_to_end_through_the_embedded_engine():
    pytest.importorskip("torch")
    embedded = pytest.importorskip("miles_engine.engines.embedded")
    if not hasattr(embedded, "load_engine"):
        pytest.skip("embedded engine not available")
    result = _invoke("check", "--family", "chatml", "--tokenizer", "builtin:bpe-chatml", "--engine", "embedded",
                     "--max-tokens", "12", "--json")
    assert result.exit_code == 0, result.output
    engine = [f for f in json.loads(result.output)["findings"] if f["check"] == "engine"]
    assert engine and all(f["ok"] for f in engine)
    assert all("sampled ids exact" in f["message"] for f in engine)
