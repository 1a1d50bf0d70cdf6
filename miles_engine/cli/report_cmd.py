"""``miles report RUN_DIR``: render a run's curves to PNG and a self-contained HTML page."""

from __future__ import annotations

import webbrowser
from pathlib import Path

import click

from miles_engine.cli.common import console, table
from miles_engine.report import render_report, trajectories_line
from miles_engine.report.html import fmt


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the PNGs and report.html (default: RUN_DIR/report).")
@click.option("--open", "open_browser", is_flag=True, help="Open report.html in a browser afterwards.")
def report(run_dir: Path, out_dir: Path | None, open_browser: bool) -> None:
    """Render RUN_DIR/metrics.jsonl: reward, tool-use rate, staleness, queue size, TIS stats,
    step-time split, eval reward and SFT loss (each when logged) to PNGs and report.html; names the
    run's trajectory record (RUN_DIR/trajectories.mtr), which ``miles dashboard RUN_DIR`` opens."""
    result = render_report(run_dir, out_dir)
    con = console()
    con.print(table(None, ["summary", "value"], [(k, fmt(v)) for k, v in result.summary.items()]))
    for png in result.pngs:
        con.print(f"  {png}")
    con.print(f"report: {result.html}")
    line = trajectories_line(run_dir)
    if line is not None:
        con.print(line[1], markup=False, highlight=False)
    if open_browser:
        webbrowser.open(result.html.resolve().as_uri())
