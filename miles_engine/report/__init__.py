"""``miles report``: a run directory's curves as PNGs and one self-contained HTML page."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from miles_engine.report.data import ReportError, RunData, edge_means, moving_average

__all__ = ["Report", "ReportError", "RunData", "edge_means", "moving_average", "render_report"]


@dataclass
class Report:
    html: Path
    pngs: list[Path] = field(default_factory=list)
    summary: dict[str, float | int | None] = field(default_factory=dict)


def render_report(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Report:
    """Read ``RUN_DIR/metrics.jsonl``; write ``<out>/<figure>.png`` and ``<out>/report.html``
    (default out: ``RUN_DIR/report``). Raises :class:`ReportError` on a missing or empty run."""
    from miles_engine.report.html import render_html
    from miles_engine.report.plots import render_pngs, require_matplotlib

    require_matplotlib()
    data = RunData.load(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    figures = render_pngs(data, out)
    summary = data.summary()
    html = out / "report.html"
    html.write_text(render_html(data, figures, summary, f"miles run report: {Path(run_dir).resolve().name}"),
                    encoding="utf-8")
    return Report(html=html, pngs=[p for _, p in figures], summary=summary)
