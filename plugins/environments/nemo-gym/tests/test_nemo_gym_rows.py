"""Dataset rows, options, the Responses-API transcript and verify replies (no server needed)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from miles_engine.errors import ConfigError, TaskFormatError, UnknownComponentError
from miles_env_nemo_gym import NemoGymOptions, NemoGymSource, load_rows, output_items, parse_verify_reply
from nemo_gym_testkit import TOOLS, make_row, write_rows

URL = "http://127.0.0.1:9"


def rows_error(tmp_path, lines: list[str], **kw) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises((TaskFormatError, ConfigError)) as err:
        load_rows(jsonl=str(path), hf_dataset=None, **kw)
    return str(err.value)


def test_row_errors_name_the_file_line_and_field(tmp_path):
    good = json.dumps(make_row(0, 1))
    msg = rows_error(tmp_path, [good, "{not json"])
    assert f"{tmp_path / 'rows.jsonl'}:2: invalid JSON" in msg
    assert "rows.jsonl:1: the row has no 'responses_create_params'" in rows_error(tmp_path, ['{"x": 1}'])
    bad_tool = make_row(0, 1)
    bad_tool["responses_create_params"]["tools"] = [{"type": "web_search"}]
    assert "tools[0]: only function tools are supported, got type 'web_search'" in rows_error(
        tmp_path, [json.dumps(bad_tool)])
    reserved = make_row(0, 1)
    reserved["responses_create_params"]["tools"] = [{"type": "function", "name": "verify"}]
    assert "tool name 'verify' is a resources-server route" in rows_error(tmp_path, [json.dumps(reserved)])
    image = make_row(0, 1)
    image["responses_create_params"]["input"][1]["content"] = [{"type": "input_image", "image_url": "x"}]
    assert "input[1]: message content part of type 'input_image' is not supported" in rows_error(
        tmp_path, [json.dumps(image)])
    assert "task id 'q0' repeats the one at" in rows_error(tmp_path, [good, good], id_field="id")
    assert "id field 'nope' is missing" in rows_error(tmp_path, [good], id_field="nope")
    assert "does not exist (option 'jsonl')" in str(pytest.raises(ConfigError, load_rows, jsonl=str(tmp_path / "x"),
                                                                  hf_dataset=None).value)


def test_options_need_one_server_and_one_dataset():
    with pytest.raises(ValidationError, match="exactly one of 'url'"):
        NemoGymOptions(jsonl="x.jsonl")
    with pytest.raises(ValidationError, match="exactly one of 'url'"):
        NemoGymOptions(jsonl="x.jsonl", url=URL, server={"command": "x", "url": URL})
    with pytest.raises(ValidationError, match="exactly one of 'jsonl' or 'hf_dataset'"):
        NemoGymOptions(url=URL)
    with pytest.raises(ValidationError, match="must be an http:// or https:// URL"):
        NemoGymOptions(url="127.0.0.1:8000", jsonl="x")
    with pytest.raises(ValidationError, match="extra"):
        NemoGymOptions(url=URL, jsonl="x", sever={})


def test_prompt_tools_ids_and_unknown_task(tmp_path):
    row = make_row(0, 5)
    row["responses_create_params"] = {"instructions": "Be terse.", "tools": TOOLS, "input": [
        {"role": "developer", "content": "dev note"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                        {"type": "input_text", "text": "there"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_secret", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "{\"secret\": 5}"}]}
    plain = make_row(1, 6)
    plain["responses_create_params"]["input"] = "just a string"
    source = NemoGymSource(NemoGymOptions(url=URL, jsonl=str(write_rows(tmp_path / "r.jsonl", [row, plain])),
                                          limit=2))
    assert [r.id for r in source.list_tasks()] == ["row-000000", "row-000001"]
    task = source.load_task("row-000000")
    assert task.prompt() == [
        {"role": "system", "content": "Be terse."}, {"role": "system", "content": "dev note"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_secret", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"secret\": 5}"}]
    assert [t.name for t in task.tools()] == ["get_secret", "multiply"]
    assert task.tools()[1].parameters["required"] == ["a", "b"] and task.sandbox_spec() is None
    assert source.load_task("row-000001").prompt() == [{"role": "user", "content": "just a string"}]
    with pytest.raises(UnknownComponentError, match="unknown task 'row-000009'.*did you mean"):
        source.load_task("row-000009")


def test_transcript_becomes_responses_api_output_items():
    transcript = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": "{\"a\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"product\": 4}"},
        {"role": "assistant", "content": "4"},
    ]
    items = output_items(transcript)
    assert [i["type"] for i in items] == ["function_call", "function_call_output", "message"]
    assert items[0]["call_id"] == items[1]["call_id"] == "call_1" and items[0]["arguments"] == "{\"a\": 2}"
    assert items[2]["content"] == [{"type": "output_text", "text": "4", "annotations": []}]
    pytest.importorskip("openai")
    from nemo_gym_resources_server import NeMoGymResponse

    from miles_env_nemo_gym import response_object

    NeMoGymResponse.model_validate(response_object(transcript, {"tools": TOOLS}, "m"))  # what a real server checks


def test_verify_reply_parsing():
    url = "http://h/verify"
    assert parse_verify_reply(url, 200, '{"reward": 0.5, "reward_components": {"a": 1}}').reward == 0.5
    assert parse_verify_reply(url, 200, '{"reward": 1}').components == {}
    for body, why in [('{"reward": NaN}', "non-finite reward nan"), ('{"reward": true}', "reward True"),
                      ("[1]", "a JSON list, not an object"), ('{"reward": 1, "reward_components": {"a": "x"}}',
                                                              "component 'a' = 'x'")]:
        result = parse_verify_reply(url, 200, body)
        assert result.reward is None and url in result.error and why in result.error, result.error


def test_hugging_face_dataset_rows_load_offline(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [make_row(i, 2 + i) for i in range(3)]
    # nested params stored as a JSON string column, as datasets on the hub often do
    flat = [{**r, "responses_create_params": json.dumps(r["responses_create_params"])} for r in rows]
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "ds"))
    source = NemoGymSource(NemoGymOptions(url=URL, hf_dataset=str(tmp_path / "ds"), id_field="id"))
    assert [r.id for r in source.list_tasks()] == ["q0", "q1", "q2"]
    assert source.load_task("q1").prompt()[1]["content"] == "Multiply your secret by 7."
    datasets.DatasetDict({"test": datasets.Dataset.from_list(flat)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match="has no split 'train' \\(splits: test\\)"):
        NemoGymSource(NemoGymOptions(url=URL, hf_dataset=str(tmp_path / "dd")))
    assert len(NemoGymSource(NemoGymOptions(url=URL, hf_dataset=str(tmp_path / "dd"), hf_split="test")).rows) == 3
