"""``miles plugins``: what is installed, one row per registered component."""

from __future__ import annotations

import click

from miles_engine.cli.common import cli_hub, console, echo_json, table
from miles_engine.hub import iter_registrations


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.option("--all", "include_builtin", is_flag=True, help="Include the built-in plugins of miles-engine.")
def plugins(as_json: bool, include_builtin: bool) -> None:
    """List installed plugins and the components they register."""
    hub = cli_hub()
    rows = [
        {
            "distribution": reg.distribution,
            "version": reg.version,
            "kind": reg.kind,
            "name": reg.name,
            "module": reg.module,
            "builtin": reg.builtin,
            "description": reg.component.description,
        }
        for reg in iter_registrations(hub, include_builtin=include_builtin)
    ]
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no plugins installed (use --all to include built-ins)")
        return
    columns = ["distribution", "version", "kind", "name", "module", "description"]
    console().print(table(None, columns, ([r[c] for c in columns] for r in rows)))
