"""Sample assembly: each kept leaf of a session → one exact trajectory row.

Per token: ``loss_mask`` 1 only on sampled ids the trajectory owns; ``rollout_logprobs`` and
``weight_versions`` as sampled (0.0 / ``None`` on environment ids); ``routed_experts`` per
sampled token when the engine recorded them. A generation shared by several kept leaves
(branching) is owned by the oldest of them: mask 1 there, 0 in the others (its log-probs and
versions stay, for staleness accounting).
"""

from __future__ import annotations

from typing import Any

from miles_engine.tito.diagnostic import classify, summarize
from miles_engine.tito.session import Node, Session, full_row


def _diagnose(session: Session, leaf: Node) -> dict[str, Any]:
    cached = session.diagnostics.get(leaf.seq)
    if cached is not None:
        return cached
    codec = session.codec
    path = leaf.path()
    messages = [m for n in path for m in n.messages]
    row = full_row(leaf)
    sampled = [False] * len(row)
    for n in path:
        sampled[n.completion_start:n.end] = [True] * len(n.output_ids)
    canonical = codec.encode_conversation(messages, path[0].tools, add_generation_prompt=False,
                                          kwargs=path[0].kwargs)
    row_tail, canonical_tail = diagnostic_tail(session, row[-1] if row else None)
    report = classify(row + row_tail, sampled + [False] * len(row_tail), canonical + canonical_tail,
                      codec.tokenizer)
    session.diagnostics[leaf.seq] = report
    return report


def diagnostic_tail(session: Session, last_id: int | None) -> tuple[list[int], list[int]]:
    """Ids that close the last turn for comparison: the merge's closing ids on the row side
    (ChatML's ``\\n``); on the canonical side the next-turn opener a GLM model sampled as stop."""
    codec = session.codec
    close, _ = codec.family.merge(codec, last_id, [])
    return close, codec.family.canonical_tail(codec, last_id)


def wire_of(session: Session) -> str | None:
    """The wire format the session's turns came through (``chat``, ``messages``, ``responses``;
    ``mixed`` when several; None before any turn)."""
    if not session.wires:
        return None
    return next(iter(session.wires)) if len(session.wires) == 1 else "mixed"


def assemble(session: Session, *, diagnose: bool = True) -> list[dict[str, Any]]:
    leaves = session.kept_leaves()
    wire = wire_of(session)
    owner: dict[int, int] = {}
    for leaf in leaves:
        for n in leaf.path():
            owner.setdefault(n.seq, leaf.seq)
    out = []
    for leaf in leaves:
        row = full_row(leaf)
        mask = [0] * len(row)
        logprobs = [0.0] * len(row)
        versions: list[int | None] = [None] * len(row)
        routed: list[Any] | None = None
        turns = []
        for n in leaf.path():
            s, e = n.completion_start, n.end
            owned = owner[n.seq] == leaf.seq
            if owned:
                mask[s:e] = [1] * (e - s)
            logprobs[s:e] = n.logprobs
            versions[s:e] = n.versions
            if n.routed_experts is not None:
                routed = routed if routed is not None else [None] * len(row)
                routed[s:e] = n.routed_experts
            turns.append({"node_id": n.seq, "prompt_start": n.start, "completion_start": s, "completion_end": e,
                          "finish_reason": n.finish_reason, "owned": owned,
                          "weight_versions": sorted(set(n.versions))})
        entry: dict[str, Any] = {
            "leaf_id": leaf.seq,
            "token_ids": row,
            "loss_mask": mask,
            "rollout_logprobs": logprobs,
            "weight_versions": versions,
            "prompt_length": leaf.path()[0].completion_start,
            "turns": turns,
            "messages": [m for n in leaf.path() for m in n.messages],
            "wire": wire,
        }
        if routed is not None:
            entry["routed_experts"] = routed
        if diagnose:
            entry["tito_session_mismatch"] = _diagnose(session, leaf)
        out.append(entry)
    return out


def session_report(session: Session) -> dict[str, Any]:
    trajectories = assemble(session, diagnose=session.diagnose)
    return {
        "session_id": session.id,
        "mode": session.mode,
        "family": session.codec.name,
        "metadata": session.metadata,
        "wire": wire_of(session),
        "trajectories": trajectories,
        "metrics": summarize([t["tito_session_mismatch"] for t in trajectories if "tito_session_mismatch" in t]),
    }
