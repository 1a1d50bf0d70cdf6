"""The warm start trains on exactly the rows the TITO session server builds at rollout time."""

from __future__ import annotations

import asyncio

from miles_engine.hub import Hub
from miles_engine.tito import make_codec
from miles_engine.tito.messages import normalize_messages, normalize_tools
from miles_engine.tito.service import SessionManager
from miles_engine.engines.scripted import ScriptedEngine
from miles_engine.models.policy_tokenizer import TokenizerConfig, policy_tokenizer
from miles_engine.tito.rows import assistant_text, conversation_row
from miles_engine.hub import default_hub


def drills_codec(n: int = 400):
    source = Hub().create("environment", "shell-drills", {"kinds": ["echo", "calc"]})
    demos = list(source.demonstrations(n, seed=3))
    boot = make_codec("chatml", "builtin:bpe-chatml", hub=default_hub())
    texts = [boot.render(normalize_messages(d.conversation()), normalize_tools(d.tools), add_generation_prompt=False)
             for d in demos]
    tok = policy_tokenizer("chatml", texts, TokenizerConfig(vocab_size=1024, cache=False))
    return make_codec("chatml", tok, hub=default_hub()), demos


def test_policy_tokenizer_has_no_fake_special_tokens():
    codec, _ = drills_codec()
    tok = codec.tokenizer
    specials = [t for t in tok.added_tokens]
    leaky = [tok.piece(i) for i in range(tok.vocab_size)
             if i not in tok.added_ids and any(s in tok.piece(i) for s in specials)]
    assert not leaky, leaky[:5]


def test_sft_rows_equal_the_session_servers_rows():
    codec, demos = drills_codec()

    async def served_row(demo) -> tuple[list[int], list[int]]:
        tools = normalize_tools(demo.tools)
        history = normalize_messages(list(demo.prompt))
        turns = normalize_messages([*demo.prompt, *demo.messages])[len(history):]
        replies: list[list[int]] = []
        for message in turns:
            if message["role"] == "assistant":
                replies.append(codec.tokenizer.encode(assistant_text(codec, history, message, tools))
                               + [codec.stop_ids[0]])
            history.append(message)
        engine = ScriptedEngine(codec.tokenizer, lambda _ids, _req: replies.pop(0))
        manager = SessionManager(engine, codec)
        session = manager.create({"mode": "linear"})
        sent, ids = list(demo.prompt), {}
        for message in demo.messages:  # replay what the server answered, as a real harness does
            if message["role"] == "assistant":
                completion, _ = await manager.chat(session.id, {"messages": sent, "tools": demo.tools,
                                                                "max_tokens": 64})
                reply = {k: v for k, v in completion.message.items() if v is not None}
                for ours, theirs in zip(message.get("tool_calls") or [], reply.get("tool_calls") or []):
                    ids[ours["id"]] = theirs["id"]
                sent.append(reply)
            else:
                sent.append({**message, "tool_call_id": ids.get(message.get("tool_call_id"))})
        row = manager.trajectories(session.id)["trajectories"][-1]
        return row["token_ids"], row["loss_mask"]

    for demo in demos[:12]:
        expected = conversation_row(codec, demo.prompt, demo.messages, demo.tools)
        assert asyncio.run(served_row(demo)) == expected, demo.to_dict()
