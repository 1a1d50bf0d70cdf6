"""Helpers shared by CLI commands: option parsing, component construction, output."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import click

from miles_engine.config.yaml_source import apply_overrides
from miles_engine.hub import Hub, default_hub


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``-o key=value`` pairs (values parsed as YAML, dotted keys nest) → dict."""
    return apply_overrides({}, list(pairs))


option_flag = click.option(
    "-o",
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Component option (repeatable); values are YAML, dotted keys nest.",
)


def build_environment(hub: Hub, name: str, options: dict[str, Any], path: str | None = None) -> Any:
    if path is not None:
        options = {**options, "path": path}
    return hub.create("environment", name, options, where=f"environment '{name}' options")


def build_sandbox_backend(hub: Hub, name: str, options: dict[str, Any]) -> Any:
    return hub.create("sandbox", name, options, where=f"sandbox backend '{name}' options")


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Any:
    from rich.table import Table

    t = Table(title=title, show_lines=False, header_style="bold")
    for col in columns:
        t.add_column(col, overflow="fold")
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    return t


def cli_hub() -> Hub:
    """The plugin hub of this command invocation: built once at the entry point, shared by every
    part of the command (outside a command: the process's hub)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return default_hub()
    meta = ctx.find_root().meta
    if "miles.hub" not in meta:
        meta["miles.hub"] = default_hub()
    return meta["miles.hub"]
