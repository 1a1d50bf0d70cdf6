"""Transcripts → token rows: the loss mask covers exactly the assistant tokens of the family's
render, and each kind of bad transcript gives one line naming the file, the row and the field."""

from __future__ import annotations

import json

import pytest

from miles_engine.data.errors import DataError
from miles_engine.hub import Hub
from miles_engine.tito import make_codec
from miles_engine.tito.messages import normalize_messages, normalize_tools
from miles_engine.models.policy_tokenizer import TokenizerConfig, policy_tokenizer
from miles_engine.sft.dataset import SFTDatasetConfig, load_sft_data, read_transcripts, schedule
from miles_engine.hub import default_hub


def drill_rows(n: int, seed: int = 3) -> list[dict]:
    source = Hub().create("environment", "shell-drills", {"kinds": ["echo", "calc"]})
    return [{"task_id": d.task.id, "messages": d.conversation(), "tools": d.tools}
            for d in source.demonstrations(n, seed=seed)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def codec():
    boot = make_codec("chatml", "builtin:bpe-chatml", hub=default_hub())
    rows = drill_rows(200)
    texts = [boot.render(normalize_messages(r["messages"]), normalize_tools(r["tools"]), add_generation_prompt=False)
             for r in rows]
    tokenizer = policy_tokenizer("chatml", texts, TokenizerConfig(vocab_size=600, cache=False))
    return make_codec("chatml", tokenizer, hub=default_hub())


def assistant_spans(codec, messages, tools) -> list[tuple[int, int]]:
    """Character spans of each assistant turn (its text and its stop token) in the full render."""
    msgs, tools = normalize_messages(messages), normalize_tools(tools)
    stop = codec.family.stop_tokens[0]
    spans = []
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        opener = codec.render(msgs[:j], tools, add_generation_prompt=True)
        full = codec.render(msgs[:j + 1], tools, add_generation_prompt=False)
        end = full.rindex(stop) + len(stop)
        spans.append((len(opener), end))
    return spans


def test_loss_mask_is_exactly_the_assistant_tokens_of_the_render(tmp_path, codec):
    rows = drill_rows(24, seed=5)
    assert any(m.get("tool_calls") for r in rows for m in r["messages"])  # tool calls and results are covered
    cfg = SFTDatasetConfig(path=write_jsonl(tmp_path / "t.jsonl", rows), fields={"id": "task_id"})
    data = load_sft_data(codec, cfg)
    assert len(data.train) == 24 and not data.eval
    tok = codec.tokenizer
    for (ids, mask), row in zip(data.train, rows):
        full = codec.render(normalize_messages(row["messages"]), normalize_tools(row["tools"]),
                            add_generation_prompt=False)
        spans = assistant_spans(codec, row["messages"], row["tools"])
        assert len(spans) == sum(m["role"] == "assistant" for m in row["messages"])
        offset = 0
        for i, token in enumerate(ids):  # token by token: where its text lies in the render
            end = len(tok.decode(ids[:i + 1]))
            inside = any(a <= offset and end <= b for a, b in spans)
            assert mask[i] == int(inside), (i, tok.decode([token]), row["task_id"])
            offset = end
        assert full.startswith(tok.decode(ids))


def test_packing_and_epochs_schedule_is_seeded_and_within_budget():
    rows = [([0] * n, [0] * n) for n in (5, 9, 3, 12, 7, 4, 8)]
    plan = schedule(rows, epochs=2, batch_size=3, pack_tokens=15, seed=1)
    assert plan == schedule(rows, epochs=2, batch_size=3, pack_tokens=15, seed=1)
    assert all(sum(len(rows[i][0]) for i in b) <= 15 for b in plan)
    half = len(plan) // 2
    assert sorted(i for b in plan[:half] for i in b) == list(range(7))  # epoch 1 covers every row once
    assert plan[:half] != plan[half:]  # epoch 2 reshuffled
    assert len(schedule(rows, epochs=1.5, batch_size=2, pack_tokens=None, seed=0)) == 6  # ceil(4 * 1.5)


def _error(cfg, codec) -> str:
    with pytest.raises(DataError) as info:
        load_sft_data(codec, cfg)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_tool_result_naming_an_unknown_call_id(tmp_path, codec):
    rows = drill_rows(5)
    tool_at = next(i for i, m in enumerate(rows[3]["messages"]) if m["role"] == "tool")
    rows[3]["messages"][tool_at]["tool_call_id"] = "call_nope"
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    text = _error(SFTDatasetConfig(path=path), codec)
    assert text.startswith(f"{path}: row 4: field 'messages[{tool_at}].tool_call_id': ")
    assert "call_nope" in text
    ok = load_sft_data(codec, SFTDatasetConfig(path=path, skip_bad_rows=True))
    assert len(ok.train) == 4 and ok.bad.count == 1 and "row 4" in ok.bad.summary()


def test_row_missing_the_messages_field(tmp_path, codec):
    rows = drill_rows(3)
    rows[1] = {"task_id": "x", "conversation": rows[1]["messages"]}
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    assert _error(SFTDatasetConfig(path=path), codec) == f"{path}: row 2: field 'messages': is missing"


def test_template_that_cannot_render_a_row(tmp_path):
    from miles_engine.tito.families.chatml import CHATML_TEMPLATE, ChatMLFamily

    class NoSecondSystem(ChatMLFamily):  # a template that refuses a system message after the first turn
        name = "strict-chatml"
        template = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                    "{{ raise_exception('system messages must come first') }}{% endif %}{% endfor %}"
                    + CHATML_TEMPLATE)

    strict = make_codec(NoSecondSystem(), "builtin:bpe-chatml", hub=default_hub())
    rows = drill_rows(3)
    rows[2]["messages"].insert(2, {"role": "system", "content": "a second system message"})
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    text = _error(SFTDatasetConfig(path=path), strict)
    assert text.startswith(f"{path}: row 3: field 'messages': chat family 'strict-chatml' cannot render it: "), text
    assert "system messages must come first" in text


def test_transcripts_read_the_same_from_jsonl_parquet_and_save_to_disk(tmp_path):
    import datasets

    rows = drill_rows(10)
    jsonl = write_jsonl(tmp_path / "t.jsonl", rows)
    ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=str(tmp_path / "cache"))
    ds.to_parquet(str(tmp_path / "t.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    read = [read_transcripts(SFTDatasetConfig(path=str(p), cache_dir=str(tmp_path / "cache")))
            for p in (jsonl, tmp_path / "t.parquet", tmp_path / "disk")]
    assert [(t.prompt, t.turns, t.tools) for t in read[0]] == [(t.prompt, t.turns, t.tools) for t in read[1]]
    assert [(t.prompt, t.turns, t.tools) for t in read[0]] == [(t.prompt, t.turns, t.tools) for t in read[2]]
    first = rows[0]["messages"]
    assert read[0][0].prompt + read[0][0].turns == first  # nothing added by Arrow's column unification
