"""The overview's curves as Plotly figure data: one trace per (run, metric), runs overlaid.

A chart lists the metric keys it draws (exact names, aliases resolved by :class:`RunData`, or a
predicate over a run's keys); a chart none of the runs has data for is left out. The browser draws
the returned dicts with ``Plotly.react`` (the same call extends them when a followed run grows).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.dashboard.data import RunView
from miles_engine.metrics import keys as K
from miles_engine.report.data import RunData

Trace = dict[str, Any]
_ESTIMATE = re.compile(r"^eval/(reward|pass@\d+)$")
_DASHES = ("solid", "dot", "dash", "dashdot", "longdash")  # one per run: overlaid runs stay apart


@dataclass(frozen=True)
class ChartSpec:
    id: str
    title: str
    keys: Callable[[RunData], list[str]]
    kind: str = "train"
    y_title: str = ""
    stacked: Sequence[str] = field(default_factory=tuple)  # keys drawn as a stacked area (per run)


def _present(*wanted: str) -> Callable[[RunData], list[str]]:
    def pick(data: RunData) -> list[str]:
        return [k for k in wanted if data.resolve(k) is not None]
    return pick


def _matching(test: Callable[[str], bool], kind: str = "train") -> Callable[[RunData], list[str]]:
    return lambda data: sorted(k for k in data.keys(kind) if test(k))


def _reward_keys(data: RunData) -> list[str]:
    return _present(K.REWARD_MEAN)(data) + [K.REWARD_PREFIX + kind for kind in data.reward_kinds()]


def _tis_keys(data: RunData) -> list[str]:
    named = _present(K.TIS_CLIPPED_FRAC, K.TIS_ABS_RATIO_MINUS_1)(data)
    clip = [k for k in sorted(data.keys("train")) if "clip" in k and k not in named
            and not any(k in K.spellings(n) for n in named)]
    return named + clip


def _time_keys(data: RunData) -> list[str]:
    parts = [k for k in K.TIME_SPLIT if data.resolve(k)]
    others = sorted(k for k in data.keys("train") if k.startswith("time/") and k not in parts and k != K.TIME_STEP)
    return parts + others + _present(K.TIME_STEP)(data)


CHARTS: tuple[ChartSpec, ...] = (
    ChartSpec("reward", "Reward (mean, per task kind)", _reward_keys, y_title="reward"),
    ChartSpec("eval", "Evaluation (95% interval bands)", _matching(lambda k: bool(_ESTIMATE.match(k)), "eval"),
              kind="eval", y_title="score"),
    ChartSpec("staleness", "Staleness (versions behind)",
              _present(K.STALENESS_AVG, K.STALENESS_MAX, K.STALENESS_TOKEN_AVG, K.VERSION_COVERAGE)),
    ChartSpec("tis", "TIS and clip fractions", _tis_keys, y_title="fraction"),
    ChartSpec("gap", "Trainer vs rollout log-prob gap",
              _present(K.PRECISION_GAP_MEAN, K.PRECISION_GAP_MAX, K.TIS_LOGPROB_DIFF, K.PRECISION_RATIO_SPREAD)),
    ChartSpec("truncation", "Truncation", _matching(lambda k: "trunc" in k), y_title="rate"),
    ChartSpec("engine", "Engine", _matching(lambda k: k.startswith(("engine/", "engines/")))),
    ChartSpec("sandbox", "Sandbox", _matching(lambda k: k.startswith("sandbox/"))),
    ChartSpec("time", "Step time split (stacked; time/step as a line)", _time_keys, y_title="seconds",
              stacked=K.TIME_SPLIT),
)


def _traces(spec: ChartSpec, run: RunView, data: RunData) -> list[Trace]:
    out: list[Trace] = []
    for key in spec.keys(data):
        steps, values = data.series(key, spec.kind)
        if not steps:
            continue
        trace: Trace = {"x": steps, "y": values, "name": f"{run.name}: {key}", "meta": {"run": run.index, "key": key},
                        "legendgroup": f"run{run.index}", "mode": "lines+markers", "type": "scatter",
                        "line": {"dash": _DASHES[run.index % len(_DASHES)]}}
        if spec.stacked and key != K.TIME_STEP:
            trace.update(stackgroup=f"run{run.index}", mode="lines")
        if spec.id == "eval":
            out.extend(_band(run, data, key, spec.kind))
        out.append(trace)
    return out


def _band(run: RunView, data: RunData, key: str, kind: str) -> list[Trace]:
    """The 95% interval of an eval estimate as a filled band (low edge, then high filled to it)."""
    lo_steps, lo = data.series(key + "_ci_low", kind)
    hi_steps, hi = data.series(key + "_ci_high", kind)
    if not lo or lo_steps != hi_steps:
        return []
    edge = {"mode": "lines", "line": {"width": 0}, "showlegend": False, "hoverinfo": "skip", "type": "scatter",
            "legendgroup": f"run{run.index}", "meta": {"run": run.index, "key": key, "band": True}}
    return [{**edge, "x": lo_steps, "y": lo, "name": f"{key} 95% low"},
            {**edge, "x": hi_steps, "y": hi, "name": f"{key} 95% interval", "fill": "tonexty",
             "fillcolor": "rgba(99,110,250,0.18)"}]


def figures(runs: Sequence[RunView]) -> list[dict[str, Any]]:
    """Every chart with data in at least one run: ``{"id", "title", "data": [...], "layout": {...}}``."""
    datas = [(run, run.data) for run in runs]
    out = []
    for spec in CHARTS:
        traces = [t for run, data in datas for t in _traces(spec, run, data)]
        if traces:
            out.append({"id": spec.id, "title": spec.title, "data": traces, "layout": {
                "title": {"text": spec.title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
                "margin": {"l": 50, "r": 10, "t": 36, "b": 36},
                "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": spec.y_title}},
                "legend": {"orientation": "h", "y": -0.2}, "height": 320}})
    return out


def eval_rows(run: RunView) -> list[dict[str, Any]]:
    """The run's eval metric rows (one per evaluation), as logged."""
    rows = run.data.by_kind.get("eval", {})
    return [{"step": step, **rows[step]} for step in sorted(rows)]
