"""``miles env``: list environments, their tasks, and self-check them without a model."""

from __future__ import annotations

import asyncio
import sys
import time

import click

from miles_engine.cli.common import (
    build_environment,
    build_sandbox_backend,
    cli_hub,
    console,
    echo_json,
    option_flag,
    parse_options,
    table,
)
from miles_engine.environments.capabilities import preflight
from miles_engine.rollout.validate import TaskCheck, validate_environment

path_flag = click.option("--path", type=click.Path(exists=True, file_okay=False), default=None,
                         help="Task directory root (sets the environment's 'path' option).")


@click.group()
def env() -> None:
    """Environments (task sources)."""


@env.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json: bool) -> None:
    """List registered environments."""
    regs = cli_hub().registry("environment").values()
    rows = [{"name": r.name, "distribution": r.distribution, "version": r.version,
             "description": r.component.description} for r in regs]
    if as_json:
        echo_json(rows)
    else:
        console().print(table(None, ["name", "distribution", "version", "description"],
                              ([r["name"], r["distribution"], r["version"], r["description"]] for r in rows)))


@env.command()
@click.argument("name")
@path_flag
@option_flag
@click.option("--json", "as_json", is_flag=True)
def tasks(name: str, path: str | None, options: tuple[str, ...], as_json: bool) -> None:
    """List the tasks of environment NAME."""
    source = build_environment(cli_hub(), name, parse_options(options), path)
    refs = list(source.list_tasks())
    if as_json:
        echo_json([r.model_dump(mode="json") for r in refs])
        return
    console().print(table(f"{name}: {len(refs)} tasks", ["id", "difficulty", "tags", "description"],
                          ([r.id, r.difficulty, ",".join(r.tags), r.description] for r in refs)))


@env.command()
@click.argument("name")
@path_flag
@option_flag
@click.option("--jobs", "-j", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Tasks checked concurrently.")
@click.option("--backend", default="local", show_default=True, help="Sandbox backend.")
@click.option("--sandbox-option", "sandbox_options", multiple=True, metavar="KEY=VALUE")
@click.option("--task", "task_ids", multiple=True, help="Check only these task ids (repeatable).")
@click.option("--json", "as_json", is_flag=True)
def validate(name: str, path: str | None, options: tuple[str, ...], jobs: int, backend: str,
             sandbox_options: tuple[str, ...], task_ids: tuple[str, ...], as_json: bool) -> None:
    """Run each task with its reference solution (must score 1.0) and doing nothing (must score 0.0)."""
    hub = cli_hub()
    source = build_environment(hub, name, parse_options(options), path)
    sandbox_backend = build_sandbox_backend(hub, backend, parse_options(sandbox_options))
    try:
        preflight(source, backend, sandbox_backend)
    except BaseException:
        asyncio.run(sandbox_backend.aclose())
        raise
    out = console()
    started = time.perf_counter()

    def progress(check: TaskCheck) -> None:
        if not as_json:
            mark = "[green]ok[/]" if check.passed else "[red]FAIL[/]"
            out.print(f"{mark} {check.task_id} ({check.seconds:.1f}s)" +
                      ("".join(f"\n    {p}" for p in check.problems)))

    async def run() -> list[TaskCheck]:
        try:
            return await validate_environment(source, sandbox_backend, hub=hub, task_ids=list(task_ids) or None,
                                              jobs=jobs, on_result=progress)
        finally:
            await sandbox_backend.aclose()

    checks = asyncio.run(run())
    wall = time.perf_counter() - started
    failed = [c for c in checks if not c.passed]
    if as_json:
        echo_json({"environment": name, "wall_s": round(wall, 3), "tasks": [c.to_dict() for c in checks]})
    else:
        out.print(f"\n{name}: {len(checks) - len(failed)}/{len(checks)} tasks passed in {wall:.1f}s "
                  f"(jobs={jobs}, backend={backend})")
    if failed:
        click.echo("failed tasks: " + ", ".join(c.task_id for c in failed), err=True)
        sys.exit(1)
    if not checks:
        click.echo(f"environment '{name}' has no tasks", err=True)
        sys.exit(1)
