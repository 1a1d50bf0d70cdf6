"""``miles recipes``: list, show, copy and validate packaged recipes."""

from __future__ import annotations

import shutil
from pathlib import Path

import click
import yaml

from miles_engine.cli.common import cli_hub, console, echo_json, table
from miles_engine.config.recipe import load_recipe, resolve_recipe_path
from miles_engine.errors import ConfigError
from miles_engine.run.policy import check_model_section


@click.group()
def recipes() -> None:
    """Packaged recipes (YAML files; each starts with the command that runs it)."""


@recipes.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json: bool) -> None:
    """List packaged recipes."""
    regs = cli_hub().registry("recipe").values()
    rows = [{"name": r.name, "distribution": r.distribution, "command": r.component.description,
             "path": str(r.component.path)} for r in regs]  # type: ignore[union-attr]
    if as_json:
        echo_json(rows)
    else:
        console().print(table(None, ["name", "distribution", "command"],
                              ([r["name"], r["distribution"], r["command"]] for r in rows)))


@recipes.command()
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--resolved", is_flag=True, help="Print the validated config with defaults and overrides applied.")
def show(recipe: str, overrides: tuple[str, ...], resolved: bool) -> None:
    """Print a recipe (a packaged name or a path)."""
    if resolved or overrides:
        cfg = load_recipe(recipe, list(overrides), hub=cli_hub())
        click.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)
    else:
        click.echo(resolve_recipe_path(recipe, hub=cli_hub()).read_text(encoding="utf-8"), nl=False)


@recipes.command()
@click.argument("recipe")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite DEST if it exists.")
def cp(recipe: str, dest: Path, force: bool) -> None:
    """Copy a packaged recipe to DEST (a file or a directory) for editing."""
    src = resolve_recipe_path(recipe, hub=cli_hub())
    target = dest / src.name if dest.is_dir() else dest
    if target.exists() and not force:
        raise ConfigError(f"'{target}' already exists; pass --force to overwrite it")
    if not target.parent.is_dir():
        raise ConfigError(f"directory '{target.parent}' does not exist")
    shutil.copyfile(src, target)
    click.echo(str(target))


@recipes.command()
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
def validate(recipe: str, overrides: tuple[str, ...]) -> None:
    """Validate a recipe and its overrides without running anything."""
    cfg = load_recipe(recipe, list(overrides), hub=cli_hub())
    model = check_model_section(cfg)  # model.path: resolved (no weights loaded), tokenizer located
    click.echo(f"ok: {recipe}" + (f" ({model})" if model else ""))
