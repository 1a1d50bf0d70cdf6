"""What the trajectory and eval pages show, computed server-side (the browser gets one page of it).

The token row is rendered here as HTML spans (``TOKENS_PER_PAGE`` at a time: a 200K-token
trajectory must not freeze the page); each span carries its numbers as data attributes and the
page's script colours them by the measure the reader picks.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

TOKENS_PER_PAGE = 4000
MESSAGE_CHARS = 20_000  # a longer message is cut (the exact text is in the token row)
OUTPUT_CHARS = 8_000
MEASURES = {"gap": "train-rollout gap |trainer - rollout|", "logprob": "rollout log-prob",
            "version": "weight version", "mask": "loss mask"}


def _num(values: Sequence[Any] | None, i: int) -> Any:
    if values is None or i >= len(values):
        return None
    return values[i]


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else ""
    return str(v)


@dataclass
class TokenPage:
    html: str
    page: int
    pages: int
    first: int  # index of the first token shown
    shown: int
    total: int
    has_trainer: bool
    default_measure: str

    @property
    def paged(self) -> bool:
        return self.pages > 1


def token_page(body: dict[str, Any], page: int = 1, per_page: int = TOKENS_PER_PAGE) -> TokenPage:
    ids = body.get("token_ids") or []
    pieces = body.get("pieces") or []
    total = len(ids)
    pages = max(1, math.ceil(total / per_page))
    page = min(max(1, page), pages)
    first = (page - 1) * per_page
    rollout, trainer = body.get("rollout_logprobs"), body.get("trainer_logprobs")
    mask, versions = body.get("loss_mask"), body.get("weight_versions")
    spans = []
    for i in range(first, min(total, first + per_page)):
        piece = pieces[i] if i < len(pieces) else f"<{ids[i]}>"
        lp, tlp = _num(rollout, i), _num(trainer, i)
        gap = abs(tlp - lp) if isinstance(lp, int | float) and isinstance(tlp, int | float) else None
        m, v = _num(mask, i), _num(versions, i)
        title = (f"#{i} id {ids[i]} {json.dumps(piece, ensure_ascii=False)}\nrollout logp {_fmt(lp)}"
                 + (f"\ntrainer logp {_fmt(tlp)}\ngap {_fmt(gap)}" if trainer is not None else "")
                 + f"\nversion {_fmt(v)}\nloss mask {_fmt(m)}")
        spans.append(f'<span class="tok" data-i="{i}" data-lp="{_fmt(lp)}" data-gap="{_fmt(gap)}" '
                     f'data-v="{_fmt(v)}" data-m="{_fmt(m)}" title="{escape(title)}">{escape(piece)}</span>')
    return TokenPage("".join(spans), page, pages, first, len(spans), total, trainer is not None,
                     "gap" if trainer is not None else "logprob")


def _cut(text: Any, limit: int) -> tuple[str, int]:
    """``text`` as a string cut at ``limit`` characters, and how many were left out."""
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, indent=1)
    return (s[:limit], len(s) - limit) if len(s) > limit else (s, 0)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for m in body.get("messages") or []:
        content, cut = _cut(m.get("content") or "", MESSAGE_CHARS)
        calls = m.get("tool_calls")
        out.append({"role": m.get("role", "?"), "content": content, "cut": cut,
                    "tool_calls": json.dumps(calls, ensure_ascii=False, indent=1) if calls else None})
    return out


def commands(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The sandbox's commands (output cut) and their timeline as one Plotly bar trace."""
    rows = []
    for n, c in enumerate(body.get("commands") or []):
        output, cut = _cut(c.get("output") or "", OUTPUT_CHARS)
        rows.append({**c, "n": n, "output": output, "cut": cut})
    if not rows:
        return rows, []
    colour = {True: "#2ca02c", False: "#d62728", None: "#999999"}
    labels = [f"#{r['n']} {str(r.get('command', ''))[:40]}" for r in rows]
    trace = {"type": "bar", "orientation": "h", "y": labels, "x": [float(r.get("duration_s") or 0) for r in rows],
             "base": [float(r.get("started_s") or 0) for r in rows],
             "marker": {"color": [colour[r.get("exit_code") == 0 if r.get("exit_code") is not None else None]
                                  for r in rows]},
             "text": [f"exit {r.get('exit_code')}" for r in rows], "hovertemplate": "%{y}<br>start %{base:.2f}s, "
             "%{x:.2f}s<br>%{text}<extra></extra>"}
    return rows, [trace]


# --- eval ------------------------------------------------------------------------------------


@dataclass
class EvalSummary:
    run: int
    step: int
    path: Path
    per_task: dict[str, float]  # mean reward over scored attempts
    attempts: int
    scored: int
    errors: int

    @property
    def key(self) -> str:
        return f"{self.run}:{self.step}"

    @property
    def mean(self) -> float | None:
        return sum(self.per_task.values()) / len(self.per_task) if self.per_task else None


def load_eval(run: int, step: int, path: Path) -> EvalSummary:
    """The evaluation's per-task values (cached until its file changes: the eval page reads them all)."""
    st = path.stat()
    return _load_eval(run, step, path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _load_eval(run: int, step: int, path: Path, mtime_ns: int, size: int) -> EvalSummary:
    from miles_engine.evaluation.runner import per_task_values, read_records

    records = read_records(path)
    scored = sum(r.ok for r in records)
    return EvalSummary(run, step, path, per_task_values(records), len(records), scored, len(records) - scored)


def compare(a: EvalSummary, b: EvalSummary) -> dict[str, Any]:
    """Per-task values of two evaluations and the paired difference ``b - a`` over the shared tasks."""
    from miles_engine.evaluation.stats import paired_difference

    tasks = sorted(set(a.per_task) | set(b.per_task))
    rows = [{"task_id": t, "a": a.per_task.get(t), "b": b.per_task.get(t),
             "diff": (b.per_task[t] - a.per_task[t]) if t in a.per_task and t in b.per_task else None} for t in tasks]
    shared = set(a.per_task) & set(b.per_task)
    est = paired_difference(b.per_task, a.per_task, resamples=1000) if shared else None
    return {"rows": rows, "shared": len(shared), "estimate": est}
