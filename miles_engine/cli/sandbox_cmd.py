"""``miles sandbox``: run one command in a sandbox, check a backend's isolation, sweep a
run's leftover remote sandboxes."""

from __future__ import annotations

import asyncio
from typing import Any

import click

from miles_engine.cli.common import (
    build_sandbox_backend,
    cli_hub,
    console,
    echo_json,
    option_flag,
    parse_options,
    table,
)
from miles_engine.errors import ConfigError
from miles_engine.sandbox.hostile import CASE_NAMES, default_spec, run_hostile_suite
from miles_engine.sandbox.protocol import RUN_LABEL, NetworkPolicy, SweepableBackend

backend_flag = click.option(
    "--backend", default="local", show_default=True, help="Sandbox backend: a registered name or a dotted import path."
)


@click.group()
def sandbox() -> None:
    """Run commands in sandboxes and check how well a backend isolates them."""


def _env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env expects KEY=VALUE, got '{pair}'")
        env[key] = value
    return env


@sandbox.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@backend_flag
@option_flag
@click.option("--timeout", "timeout_s", type=float, default=None, help="Seconds before the command is killed.")
@click.option(
    "--network",
    type=click.Choice(["none", "public"]),
    default=None,
    help="Network policy (default: none when the backend can block it, else public).",
)
@click.option("--workdir", default=None, help="Directory the command starts in (default /app).")
@click.option("-e", "--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Extra variable (repeatable).")
@click.option("--max-output", "max_output", type=int, default=None, help="Per-stream output cap in bytes.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_cmd(
    backend: str,
    options: tuple[str, ...],
    timeout_s: float | None,
    network: str | None,
    workdir: str | None,
    env_pairs: tuple[str, ...],
    max_output: int | None,
    cmd: tuple[str, ...],
) -> None:
    """Run CMD in a fresh sandbox and print the result as JSON.

    One argument runs under ``bash -c`` (pipes, globs); several run as an argv list.
    The exit status is 0 whenever the sandbox ran, whatever the command did.
    """
    be = build_sandbox_backend(cli_hub(), backend, parse_options(options))
    spec = default_spec(be)
    updates: dict[str, Any] = {"env": _env_pairs(env_pairs)}
    if network:
        updates["network"] = NetworkPolicy(mode=network)  # type: ignore[arg-type]
    if workdir:
        updates["workdir"] = workdir
    spec = spec.model_copy(update=updates)
    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)

    async def run() -> dict[str, Any]:
        try:
            async with await be.create(spec) as sb:
                res = await sb.exec(command, timeout_s=timeout_s, max_output_bytes=max_output)
                return res.to_dict()
        finally:
            await be.aclose()

    echo_json(asyncio.run(run()))


@sandbox.command("check")
@backend_flag
@option_flag
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.option("--case", "cases", multiple=True, help="Run only this case (repeatable).")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Cases run at once.")
def check_cmd(backend: str, options: tuple[str, ...], as_json: bool, cases: tuple[str, ...], concurrency: int) -> None:
    """Run the hostile-command suite; exit 1 if any case is not contained."""
    unknown = [c for c in cases if c not in CASE_NAMES]
    if unknown:
        raise click.BadParameter(
            f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASE_NAMES)}", param_hint="--case"
        )
    be = build_sandbox_backend(cli_hub(), backend, parse_options(options))

    async def run() -> list[Any]:
        try:
            return await run_hostile_suite(be, cases=list(cases) or None, concurrency=concurrency)
        finally:
            await be.aclose()

    results = asyncio.run(run())
    if as_json:
        echo_json(
            [
                {k: v for k, v in r.to_dict().items() if k != "duration_s"} | {"duration_s": r.duration_s}
                for r in results
            ]
        )
    else:
        caps = be.capabilities()
        info = getattr(be, "describe", lambda: {})()
        title = f"sandbox backend '{backend}': isolation={caps.isolation}" + (
            f" ({info['detail']})" if info.get("detail") else ""
        )
        rows = (
            [
                r.case,
                "yes" if r.contained else "NO",
                "?" if r.leftover_processes is None else r.leftover_processes,
                f"{r.duration_s:.1f}s",
                r.detail,
            ]
            for r in results
        )
        console().print(table(title, ["case", "contained", "leftover", "time", "detail"], rows))
        bad = [r.case for r in results if not r.contained]
        click.echo(
            f"{len(results) - len(bad)}/{len(results)} contained"
            + (f"; NOT contained: {', '.join(bad)}" if bad else "")
        )
    if any(not r.contained for r in results):
        raise click.exceptions.Exit(1)


@sandbox.command("sweep")
@backend_flag
@option_flag
@click.option("--run", "run_id", required=True, help="Run id: every sandbox labelled miles.run=RUN is removed.")
@click.option("--json", "as_json", is_flag=True, help="Print the removed sandbox ids as a JSON list.")
def sweep_cmd(backend: str, options: tuple[str, ...], run_id: str, as_json: bool) -> None:
    """Remove every sandbox a run left behind on a remote backend (idempotent)."""
    if not run_id.strip():
        raise click.BadParameter("must be a non-empty run id", param_hint="--run")
    be = build_sandbox_backend(cli_hub(), backend, parse_options(options))

    async def run() -> list[str]:
        try:
            if not isinstance(be, SweepableBackend):
                raise ConfigError(
                    f"sandbox backend '{backend}' has no sweep: it creates no remote sandboxes to leave behind "
                    f"(sweep applies to backends such as docker, e2b, daytona, modal)"
                )
            return list(await be.sweep(run_id))
        finally:
            await be.aclose()

    removed = asyncio.run(run())
    if as_json:
        echo_json(removed)
    else:
        click.echo(f"removed {len(removed)} sandbox(es) labelled {RUN_LABEL}={run_id}" + "".join(f"\n  {i}" for i in removed))
