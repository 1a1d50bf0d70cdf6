"""``miles report`` draws the eval curves with their 95% intervals."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from miles_engine.report import render_report
from miles_engine.report.data import RunData
from miles_engine.report.plots import draw_eval


def eval_row(step: int, value: float) -> dict[str, float | int | str]:
    row: dict[str, float | int | str] = {"step": step, "time": float(step), "kind": "eval"}
    for name, v in (("eval/reward", value), ("eval/pass@1", value), ("eval/pass@4", min(1.0, 1.5 * value))):
        row.update({name: v, f"{name}_se": 0.05, f"{name}_ci_low": v - 0.1, f"{name}_ci_high": v + 0.1})
    return row


def test_eval_curves_with_intervals(tmp_path: Path) -> None:
    rows = [{"step": s, "time": float(s), "kind": "train", "reward/mean": s / 10} for s in range(1, 11)]
    rows += [eval_row(s, 0.1 + s / 20) for s in (0, 5, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = RunData.load(tmp_path)
    fig = Figure()
    assert draw_eval(data, fig)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["reward", "pass@1", "pass@4"]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 3  # one interval band per curve
    report = render_report(tmp_path)
    assert any(p.name == "eval.png" for p in report.pngs)
    assert report.summary["eval reward, first"] == 0.1 and report.summary["eval reward, last"] == 0.6
    assert report.summary["eval reward, last: 95% interval low"] == 0.6 - 0.1
