"""``miles new plugin --kind K NAME [--dest DIR]``: scaffold a plugin distribution."""

from __future__ import annotations

from pathlib import Path

import click

from miles_engine.scaffold import KINDS, PluginNames, scaffold_plugin


@click.group("new")
def new() -> None:
    """Create new project files from templates."""


@new.command("plugin")
@click.option("--kind", "kind", required=True, type=click.Choice(KINDS), help="What the plugin registers.")
@click.argument("name")
@click.option("--dest", default=".", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory the plugin directory NAME is created in.")
def plugin(kind: str, name: str, dest: Path) -> None:
    """Scaffold a plugin package NAME: pyproject (entry point group `miles`), plugin.py with the
    hook implementation, a component with typed options, and tests running the contract suite."""
    target = scaffold_plugin(kind, name, dest)
    names = PluginNames.of(kind, name)
    click.echo(f"created {target} ({names.distribution}, package {names.package}, {kind} '{name}')")
    click.echo(f"next: pip install -e {target} && miles plugins && pytest {target / 'tests'}")
