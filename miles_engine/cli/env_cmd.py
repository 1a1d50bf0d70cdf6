"""``miles env``: list environments, their tasks, and self-check them without a model."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

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
from miles_engine.environments.admission import TaskAdmission, admit_on
from miles_engine.rollout.validate import TaskCheck, validate_environment

path_flag = click.option("--path", type=click.Path(exists=True), default=None,
                         help="What the environment reads: a task directory root or a data file "
                              "(sets the environment's 'path' option).")
backend_flags = [
    click.option("--backend", default="local", show_default=True, help="Sandbox backend."),
    click.option("--sandbox-option", "sandbox_options", multiple=True, metavar="KEY=VALUE"),
]


def with_backend(command: Any) -> Any:
    for flag in reversed(backend_flags):
        command = flag(command)
    return command


def admission_on(hub: Any, source: Any, backend: str, sandbox_options: tuple[str, ...],
                 task_ids: list[str] | None = None) -> tuple[TaskAdmission, Any]:
    """Which tasks ``backend`` can run (each other one with its reason), and the built backend."""
    sandbox_backend = build_sandbox_backend(hub, backend, parse_options(sandbox_options))
    try:
        return admit_on(source, backend, sandbox_backend, task_ids=task_ids), sandbox_backend
    except BaseException:
        asyncio.run(sandbox_backend.aclose())
        raise


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
@with_backend
@click.option("--no-check", is_flag=True,
              help="List only; do not load each task and check it against the sandbox backend.")
@click.option("--json", "as_json", is_flag=True)
def tasks(name: str, path: str | None, options: tuple[str, ...], backend: str, sandbox_options: tuple[str, ...],
          no_check: bool, as_json: bool) -> None:
    """List the tasks of environment NAME, each with whether BACKEND can run it (and why not)."""
    hub = cli_hub()
    source = build_environment(hub, name, parse_options(options), path)
    refs = list(source.list_tasks())
    admission = None
    if not no_check:
        admission, sandbox_backend = admission_on(hub, source, backend, sandbox_options, [r.id for r in refs])
        asyncio.run(sandbox_backend.aclose())

    def status(task_id: str) -> tuple[str, str | None]:
        excluded = admission.reason(task_id) if admission is not None else None
        if admission is None:
            return "unchecked", None
        return ("ok", None) if excluded is None else (f"excluded: {excluded.kind}", excluded.reason)

    if as_json:
        echo_json([{**r.model_dump(mode="json"), "status": status(r.id)[0], "reason": status(r.id)[1]}
                   for r in refs])
        return
    out = console()
    out.print(table(f"{name}: {len(refs)} tasks", ["id", "difficulty", "tags", "description", "status"],
                    ([r.id, r.difficulty, ",".join(r.tags), r.description, status(r.id)[0]] for r in refs)))
    if admission is not None:
        out.print(admission.report(limit=len(refs)), markup=False)


@env.command()
@click.argument("name")
@path_flag
@option_flag
@click.option("--jobs", "-j", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Tasks checked concurrently.")
@with_backend
@click.option("--task", "task_ids", multiple=True, help="Check only these task ids (repeatable).")
@click.option("--json", "as_json", is_flag=True)
def validate(name: str, path: str | None, options: tuple[str, ...], jobs: int, backend: str,
             sandbox_options: tuple[str, ...], task_ids: tuple[str, ...], as_json: bool) -> None:
    """Run each task with its reference solution (must score 1.0) and doing nothing (must score 0.0)."""
    hub = cli_hub()
    source = build_environment(hub, name, parse_options(options), path)
    # each task the backend cannot run is reported with its own reason; the others are checked
    admission, sandbox_backend = admission_on(hub, source, backend, sandbox_options, list(task_ids) or None)
    # a malformed task is a failure of the check (its load error is its problem), not an exclusion
    malformed = {e.task_id for e in admission.excluded if e.kind == "malformed"}
    to_check = [t for t in dict.fromkeys(task_ids or [r.id for r in source.list_tasks()])
                if t not in admission.excluded_ids or t in malformed]
    excluded = [e for e in admission.excluded if e.kind != "malformed"]
    out = console()
    if excluded and not as_json:
        out.print("excluded (not run):" + "".join(f"\n  - {e.task_id} [{e.kind}]: {e.reason}" for e in excluded),
                  markup=False)
    started = time.perf_counter()

    def progress(check: TaskCheck) -> None:
        if not as_json:
            mark = "[green]ok[/]" if check.passed else "[red]FAIL[/]"
            out.print(f"{mark} {check.task_id} ({check.seconds:.1f}s)" +
                      ("".join(f"\n    {p}" for p in check.problems)))

    async def run() -> list[TaskCheck]:
        try:
            return await validate_environment(source, sandbox_backend, hub=hub, task_ids=to_check,
                                              jobs=jobs, on_result=progress)
        finally:
            await sandbox_backend.aclose()

    checks = asyncio.run(run())
    wall = time.perf_counter() - started
    failed = [c for c in checks if not c.passed]
    if as_json:
        echo_json({"environment": name, "wall_s": round(wall, 3), "tasks": [c.to_dict() for c in checks],
                   "excluded": [e.to_dict() for e in excluded]})
    else:
        left_out = f", {len(excluded)} excluded (not run, reasons above)" if excluded else ""
        out.print(f"\n{name}: {len(checks) - len(failed)}/{len(checks)} tasks passed{left_out} in {wall:.1f}s "
                  f"(jobs={jobs}, backend={backend})")
    if failed:
        click.echo("failed tasks: " + ", ".join(c.task_id for c in failed), err=True)
        sys.exit(1)
    if not checks:
        click.echo(f"environment '{name}' has no task that backend '{backend}' can run" if excluded
                   else f"environment '{name}' has no tasks", err=True)
        sys.exit(1)
