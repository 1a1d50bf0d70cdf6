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
    trajectories: Path | None = None  # RUN_DIR/trajectories.mtr when the run recorded one


def trajectories_line(run_dir: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """The run's trajectory record and the one line that says how to open it (None: no record)."""
    from miles_engine.metrics.trajectory_store import TRAJECTORIES_FILE

    path = Path(run_dir) / TRAJECTORIES_FILE
    if not path.is_file() or path.stat().st_size == 0:  # an SFT-only run opens it and records nothing
        return None
    return path, (f"trajectories: {path} ({path.stat().st_size / 1e6:.1f} MB); "
                  f"`miles dashboard {run_dir}` opens it")


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
    record = trajectories_line(run_dir)
    html.write_text(render_html(data, figures, summary, f"miles run report: {Path(run_dir).resolve().name}",
                                trajectories=record[1] if record else None), encoding="utf-8")
    return Report(html=html, pngs=[p for _, p in figures], summary=summary,
                  trajectories=record[0] if record else None)
