"""Demonstrations → exact token rows, laid out the way the TITO session server builds them.

Turn 1 is the chat template rendered once with the generation prompt; each assistant turn
is its text tokenized alone plus the family's first stop token (what a model samples, loss
mask 1); every environment turn after it is the family's boundary merge plus the appended
messages (loss mask 0). SFT therefore trains on the very rows RL will later sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.messages import normalize_messages, normalize_tools

Message = dict[str, Any]


def assistant_text(codec: ChatCodec, history: Sequence[Message], message: Message,
                   tools: Sequence[dict[str, Any]] | None) -> str:
    """The text the model samples for ``message`` after ``history`` (without the stop token)."""
    opener = codec.render(history, tools, add_generation_prompt=True)
    full = codec.render([*history, message], tools, add_generation_prompt=False)
    if not full.startswith(opener):
        raise ValueError(f"chat family '{codec.name}' renders an assistant turn that does not extend its opener")
    text = full[len(opener):]
    stop = codec.family.stop_tokens[0]
    cut = text.rfind(stop)
    return text[:cut] if cut >= 0 else text


def conversation_row(codec: ChatCodec, prompt: Sequence[Message], turns: Sequence[Message],
                     tools: Sequence[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """``(token_ids, loss_mask)`` for ``prompt`` followed by assistant/environment ``turns``.

    Messages are OpenAI-shaped; they are normalised exactly as the session server normalises them.
    """
    tools = normalize_tools(tools) if tools else None
    prompt = normalize_messages(list(prompt))
    normalized = normalize_messages([*prompt, *turns])[len(prompt):]
    turns = normalized
    history = list(prompt)
    ids = codec.encode_conversation(history, tools, add_generation_prompt=True)
    mask = [0] * len(ids)
    stop_id = codec.stop_ids[0]
    pending: list[Message] = []
    for message in turns:
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        if pending:
            env = codec.append_ids(ids[-1], pending, tools)
            ids += env
            mask += [0] * len(env)
            history += pending
            pending = []
        sampled = codec.tokenizer.encode(assistant_text(codec, history, message, tools)) + [stop_id]
        ids += sampled
        mask += [1] * len(sampled)
        history.append(message)
    if pending:
        raise ValueError("a demonstration must end with an assistant turn")
    return ids, mask
