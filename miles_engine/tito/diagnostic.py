"""``tito_session_mismatch``: the owned row against a canonical re-render of its history.

Both id sequences are split at the tokenizer's special tokens. Differences are classified:

- ``special_token_count`` — the rows hold a different number of special tokens (bug);
- ``special_token_type`` — same count, different special tokens somewhere (bug);
- ``non_assistant_text`` — a text run without sampled tokens differs (bug: the server
  tokenized an environment message differently from the template);
- ``assistant_text`` — a text run holding sampled tokens differs (expected: the model's own
  tokenization of its text, or a parse → re-render that is not an identity).

The first three must be 0 for a correct family and server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.models.tokenizer import TitoTokenizer

BUG_TYPES = ("special_token_count", "special_token_type", "non_assistant_text")
ALL_TYPES = (*BUG_TYPES, "assistant_text")
MAX_DETAILS = 5


def _first_difference(row: Sequence[int], canonical: Sequence[int], tok: TitoTokenizer) -> dict[str, Any] | None:
    for i, (a, b) in enumerate(zip(row, canonical)):
        if a != b:
            return {"index": i, "row": tok.describe(a), "canonical": tok.describe(b)}
    if len(row) != len(canonical):
        i = min(len(row), len(canonical))
        return {"index": i, "row": tok.describe(row[i]) if i < len(row) else None,
                "canonical": tok.describe(canonical[i]) if i < len(canonical) else None}
    return None


def classify(row: Sequence[int], sampled: Sequence[bool], canonical: Sequence[int],
             tok: TitoTokenizer) -> dict[str, Any]:
    """Compare ``row`` (with ``sampled`` flags) against ``canonical``; see the module doc."""
    special = tok.special_ids
    counts = dict.fromkeys(ALL_TYPES, 0)
    details: list[dict[str, Any]] = []
    rs = [i for i, t in enumerate(row) if t in special]
    cs = [i for i, t in enumerate(canonical) if t in special]
    if len(rs) != len(cs):
        counts["special_token_count"] = abs(len(rs) - len(cs))
        details.append({"type": "special_token_count", "row": len(rs), "canonical": len(cs),
                        "row_specials": _names(row, rs, tok), "canonical_specials": _names(canonical, cs, tok)})
    else:
        for a, b in zip(rs, cs):
            if row[a] != canonical[b]:
                counts["special_token_type"] += 1
                if len(details) < MAX_DETAILS:
                    details.append({"type": "special_token_type", "index": a,
                                    "row": tok.piece(row[a]), "canonical": tok.piece(canonical[b])})
        rb, cb = [-1, *rs, len(row)], [-1, *cs, len(canonical)]
        for k in range(len(rb) - 1):
            r0, r1, c0, c1 = rb[k] + 1, rb[k + 1], cb[k] + 1, cb[k + 1]
            if row[r0:r1] == canonical[c0:c1]:
                continue
            kind = "assistant_text" if any(sampled[r0:r1]) else "non_assistant_text"
            counts[kind] += 1
            if len(details) < MAX_DETAILS:
                rt, ct = tok.decode(row[r0:r1]), tok.decode(canonical[c0:c1])
                details.append({"type": kind, "index": r0, "same_text": rt == ct,
                                "row": rt[:200], "canonical": ct[:200]})
    found = [t for t in ALL_TYPES if counts[t]]
    return {
        "mismatch": bool(found),
        "bug": any(counts[t] for t in BUG_TYPES),
        "types": found,
        "counts": counts,
        "first_difference": _first_difference(row, canonical, tok),
        "details": details,
    }


def _names(ids: Sequence[int], positions: list[int], tok: TitoTokenizer) -> list[str]:
    names = [tok.piece(ids[p]) for p in positions]
    return names if len(names) <= 40 else [*names[:20], "…", *names[-20:]]


def summarize(reports: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Rates over trajectories: ``tito_session_mismatch_rate[/<type>]``."""
    n = len(reports)
    out: dict[str, float] = {"tito_session_mismatch_trajectories": float(n)}
    if not n:
        return out
    out["tito_session_mismatch_rate"] = sum(r["bug"] for r in reports) / n
    for t in ALL_TYPES:
        out[f"tito_session_mismatch_rate/{t}"] = sum(bool(r["counts"][t]) for r in reports) / n
    return out


def summarize_by_wire(reports: Sequence[tuple[str | None, dict[str, Any]]]) -> dict[str, float]:
    """:func:`summarize` over all ``(wire format, report)`` pairs, then per wire format with the
    format after the metric's name: ``tito_session_mismatch_rate/<wire>[/<type>]``,
    ``tito_session_mismatch_trajectories/<wire>``."""
    out = summarize([r for _, r in reports])
    for wire in sorted({w for w, _ in reports if w}):
        for key, value in summarize([r for w, r in reports if w == wire]).items():
            name, _, kind = key.partition("/")
            out[f"{name}/{wire}" + (f"/{kind}" if kind else "")] = value
    return out
