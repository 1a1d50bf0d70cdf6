"""A self-contained HTML page: summary table, the figures as data URIs, the run's config."""

from __future__ import annotations

import base64
import datetime as _dt
from html import escape
from pathlib import Path

from miles_engine.report.data import RunData

CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em auto; max-width: 1250px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.92em; }
td, th { border: 1px solid #ddd; padding: 3px 10px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.muted { color: #777; font-size: 0.85em; }
"""


def fmt(value: float | int | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:.1f}"


def _table(rows: list[tuple[str, str]], header: tuple[str, str] | None = None) -> str:
    head = f"<tr><th>{escape(header[0])}</th><th>{escape(header[1])}</th></tr>" if header else ""
    body = "".join(f"<tr><td>{escape(k)}</td><td class='num'>{escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{head}{body}</table>"


def data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def render_html(data: RunData, figures: list[tuple[str, Path]], summary: dict[str, float | int | None],
                title: str, trajectories: str | None = None) -> str:
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>",
             f"<style>{CSS}</style></head><body>", f"<h1>{escape(title)}</h1>",
             f"<p class='muted'>generated {_dt.datetime.now().isoformat(timespec='seconds')} by "
             f"<code>miles report</code>; row kinds: {escape(', '.join(sorted(data.by_kind)))}</p>",
             "<h2>Summary</h2>", _table([(k, fmt(v)) for k, v in summary.items()])]
    if trajectories:  # the line names the record file and the command that opens it
        parts.append(f"<p class='trajectories'>{escape(trajectories)}</p>")
    for fig_title, png in figures:
        parts.append(f"<h2>{escape(fig_title)}</h2><img alt='{escape(fig_title)}' src='{data_uri(png)}'>")
    if not figures:
        parts.append("<p>No known metric keys to plot (see miles_engine/metrics/keys.py).</p>")
    config = data.run_dir / "config.yaml" if data.run_dir else None
    if config is not None and config.is_file():
        parts += ["<h2>Config</h2>", f"<pre>{escape(config.read_text(encoding='utf-8', errors='replace'))}</pre>"]
    final = data.final_values("train")
    if final:
        parts += [f"<details><summary>last value of every train metric ({len(final)})</summary>",
                  _table([(k, fmt(v)) for k, v in final.items()], ("key", "last value")), "</details>"]
    parts.append("</body></html>")
    return "\n".join(parts)
