"""``miles tito``: the TITO conformance check and a standalone session server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click

from miles_engine.cli.common import cli_hub, console, echo_json, option_flag, parse_options, table
from miles_engine.engines.scripted import ScriptedEngine, random_policy
from miles_engine.models.tokenizer import load_tokenizer
from miles_engine.run.tito_serve import build_engine, default_tokenizer, fleet_groups, run_session_server, serve_fleet
from miles_engine.tito import make_codec
from miles_engine.tito.check import check_rendering
from miles_engine.tito.check_engine import engine_roundtrip
from miles_engine.tito.conversations import adapt, builtin_conversations, load_conversations
from miles_engine.tito.families.auto import resolve_family_name
from miles_engine.tito.harness_check import check_harness
from miles_engine.tito.service import SessionServerConfig

ENGINES = "random | embedded | none | an SGLang-compatible URL"


@click.group()
def tito() -> None:
    """Token-in/token-out sessions: conformance check, session server."""


async def _roundtrip(kind: str, model: str | None, codec: Any, convs: list[Any], seed: int, max_tokens: int) -> Any:
    """Build the engine and run the round trip in one event loop (HTTP clients bind to it)."""
    if kind == "random":
        engine = ScriptedEngine(codec.tokenizer, random_policy(codec.tokenizer, codec.stop_ids[:1], seed=seed))
    elif kind == "embedded":
        engine = await build_engine(model or "tiny:qwen3", None, codec.tokenizer)
    else:
        engine = await build_engine(None, kind, codec.tokenizer)
    try:
        return await engine_roundtrip(codec, convs, engine, max_tokens=max_tokens)
    finally:
        close = getattr(engine, "aclose", None)
        if close is not None:
            await close()


@tito.command("check")
@click.option("--family", required=True,
              help="Chat family: a registered name (qwen3, glm, chatml, template) or dotted path; 'auto': from the "
                   "tokenizer's chat template.")
@click.option("--tokenizer", "tokenizer_spec", required=True,
              help="tokenizer.json, a model directory, a .gguf file, or builtin:qwen3 / builtin:bpe-<family>.")
@click.option("--conversations", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON / JSON-lines conversations (default: the built-in representative set).")
@option_flag
@click.option("--engine", "engine_kind", default="random", show_default=True, help=f"End-to-end engine: {ENGINES}.")
@click.option("--model", default=None, help="Model for --engine embedded (default tiny:qwen3 sized to the tokenizer).")
@click.option("--max-tokens", default=24, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True)
def check(family: str, tokenizer_spec: str, conversations: str | None, options: tuple[str, ...], engine_kind: str,
          model: str | None, max_tokens: int, seed: int, as_json: bool) -> None:
    """Check that FAMILY renders append-only, merges boundaries, parses its own turns, and that
    rows served through the session server equal the engine's sampled ids exactly."""
    tokenizer = load_tokenizer(tokenizer_spec)
    codec = make_codec(resolve_family_name(family, None, tokenizer), tokenizer, options=parse_options(options),
                       hub=cli_hub())
    convs = load_conversations(conversations) if conversations else [
        adapt(c, has_reasoning=codec.family.has_reasoning) for c in builtin_conversations()]
    findings = check_rendering(codec, convs)
    if engine_kind != "none" and all(f.ok for f in findings):
        findings += asyncio.run(_roundtrip(engine_kind, model, codec, convs, seed, max_tokens))
    failed = [f for f in findings if not f.ok]
    if as_json:
        echo_json({"family": codec.name, "tokenizer": tokenizer_spec, "passed": not failed,
                   "findings": [f.to_dict() for f in findings]})
    else:
        rows = [(f.check, f.conversation, "info" if f.info else ("ok" if f.ok else "FAIL"), f.message)
                for f in findings]
        console().print(table(f"tito check: family {codec.name}", ["check", "conversation", "result", "detail"], rows))
        click.echo(f"{'FAILED' if failed else 'passed'}: {len(findings) - len(failed)}/{len(findings)} findings ok")
    if failed:
        sys.exit(1)


@tito.command("serve")
@click.option("--family", required=True,
              help="Chat family (registered name or dotted path); 'auto': from the model's type and chat template.")
@click.option("--model", default=None,
              help="Embedded engine model: directory, .gguf, config.json, package:<module> or tiny:<type>.")
@click.option("--engine-url", "engine_urls", multiple=True,
              help="An SGLang-compatible server to use instead of the embedded engine; repeat it for a fleet "
              "behind the router (sessions stay on their engine, new ones go to the least loaded).")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1),
              help="With --model: more than 1 launches that many supervised engine processes behind the router.")
@click.option("--engines", "engines_yaml", default=None,
              help="A recipe-style engines list, e.g. '[{kind: server, replicas: 2}]' (kinds: server, external, ...).")
@click.option("--tokenizer", "tokenizer_spec", default=None, help="Default: the model directory.")
@option_flag
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int, help="0 picks a free port.")
@click.option("--port-file", default=None)
@click.option("--mode", type=click.Choice(["linear", "branching"]), default="linear", show_default=True)
@click.option("--matcher", default="strict", show_default=True)
@click.option("--record-routed-experts", is_flag=True)
@click.option("--threads", default=None, type=click.IntRange(1))
def serve(family: str, model: str | None, engine_urls: tuple[str, ...], replicas: int, engines_yaml: str | None,
          tokenizer_spec: str | None, options: tuple[str, ...], host: str, port: int, port_file: str | None, mode: str,
          matcher: str, record_routed_experts: bool, threads: int | None) -> None:
    """Start an engine and a TITO session server (POST /sessions → an OpenAI base_url)."""
    tokenizer = load_tokenizer(default_tokenizer(model, tokenizer_spec))
    hub = cli_hub()
    codec = make_codec(resolve_family_name(family, model, tokenizer), tokenizer, options=parse_options(options),
                       hub=hub)
    config = SessionServerConfig(mode=mode, matcher=matcher, record_routed_experts=record_routed_experts)

    async def main() -> None:
        if engines_yaml or len(engine_urls) > 1 or replicas > 1:
            import tempfile

            groups = fleet_groups(model, engine_urls, replicas, engines_yaml)
            with tempfile.TemporaryDirectory(prefix="miles-fleet-") as state:
                await serve_fleet(codec, groups, model, host=host, port=port, port_file=port_file, config=config,
                                  state_dir=Path(state), hub=hub)
            return
        engine = await build_engine(model, engine_urls[0] if engine_urls else None, codec.tokenizer, threads=threads)
        await run_session_server(engine, codec, host=host, port=port, port_file=port_file, config=config)

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass


@tito.command("check-harness")
@click.argument("command", required=False, default="")
@click.option("--preset", type=click.Choice(["custom", "claude-code", "codex"]), default="custom", show_default=True,
              help="custom: COMMAND is the bash script (MILES_SESSION_URL etc. in its env).")
@click.option("--sessions", "-n", default=2, show_default=True, type=click.IntRange(1))
@click.option("--family", default="qwen3", show_default=True, help="A Hermes tool-call family (qwen3, chatml).")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=float)
@click.option("--backend", type=click.Choice(["local", "docker"]), default="local", show_default=True,
              help="Sandbox backend (docker: the engine on this host, image ubuntu:24.04 via its image map).")
@click.option("--json", "as_json", is_flag=True)
def check_harness_cmd(command: str, preset: str, sessions: int, family: str, timeout_s: float, backend: str,
                      as_json: bool) -> None:
    """Drive a harness through N sessions (a sandbox, scripted policy: one shell tool call, then an
    answer) and report per session and turn: trajectories, forks, tokens, mismatches by type."""
    from miles_engine.tito.harness import default_harness_dir

    if preset == "custom" and not command:
        raise click.UsageError("give COMMAND (a bash script) or --preset claude-code|codex")
    binds = {"ro_binds": {"/miles/harnesses": default_harness_dir()}} if preset != "custom" else {}
    opts = {**binds, "memory_mb": None} if backend == "local" else binds
    out = asyncio.run(check_harness(command, sessions=sessions, preset=preset, family=family, timeout_s=timeout_s,
                                    backend=backend, backend_options=opts, hub=cli_hub()))
    if as_json:
        echo_json(out)
    else:
        rows = []
        for i, s in enumerate(out):
            for t in s["per_turn"] or [{"turn": "-", "completion_tokens": "-", "env_tokens": "-", "finish": "-"}]:
                rows.append([str(i + 1), str(t["turn"]), str(t["completion_tokens"]), str(t["env_tokens"]),
                             str(s["trajectories"]), str(s["forks"]), str(s["mismatch"].get("non_assistant_text", "-")),
                             str(s["mismatch"].get("special_token_count", "-")), s["stop"], str(s["tool_ran"])])
        console().print(table(f"tito check-harness: {preset}", ["session", "turn", "sampled", "env ids", "trajectories",
                                                              "forks", "non-assistant", "special", "stop", "tool ran"],
                              rows))
    bad = [s for s in out if s["stop"] != "done" or s["trajectories"] != 1 or s["forks"]
           or s["mismatch"].get("non_assistant_text") or s["mismatch"].get("special_token_count")]
    for s in bad:
        click.echo(f"error: {s.get('error') or 'fork or mismatch'}", err=True)
    sys.exit(1 if bad else 0)
