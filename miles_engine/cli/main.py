"""``miles``: entry point. Subcommand groups live in their own modules and load lazily."""

from __future__ import annotations

import importlib
import sys

import click

from miles_engine import __version__
from miles_engine.errors import MilesError

# name -> ("module:attribute" of a click command, one-line help); imported only when used.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("miles_engine.cli.plugins_cmd:plugins", "List installed plugins and their components."),
    "recipes": ("miles_engine.cli.recipes_cmd:recipes", "List, show, copy and validate packaged recipes."),
    "env": ("miles_engine.cli.env_cmd:env", "List environments and tasks; self-check them without a model."),
    "sandbox": ("miles_engine.cli.sandbox_cmd:sandbox", "Run commands in a sandbox; check its isolation."),
    "train": ("miles_engine.cli.train_cmd:train", "Train a policy with a recipe (SFT warm start + async RL)."),
    "eval": ("miles_engine.cli.eval_cmd:eval_cmd", "Run a recipe's agent on its environment's tasks."),
    "tito": ("miles_engine.cli.tito_cmd:tito", "TITO sessions: conformance check, session server."),
    "serve": ("miles_engine.cli.serve_cmd:serve", "Serve a model over SGLang-compatible HTTP (embedded engine)."),
    "export": ("miles_engine.cli.export_cmd:export", "Export a run's checkpoint as a Hugging Face model directory."),
    "convert": ("miles_engine.cli.export_cmd:convert", "Write a model in a quantised format (fp8, mxfp8, nvfp4, int4)."),
    "report": ("miles_engine.cli.report_cmd:report", "Render a run's curves to PNG and HTML."),
    "dashboard": ("miles_engine.cli.dashboard_cmd:dashboard", "A read-only local web page over runs (--follow: live)."),
    "new": ("miles_engine.cli.new_cmd:new", "Scaffold a plugin package (miles new plugin --kind K NAME)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        module, _, attr = SUBCOMMANDS[cmd_name][0].partition(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="miles")
def cli() -> None:
    """miles-engine: agentic environments, sandboxes and async RL post-training."""


def main(argv: list[str] | None = None) -> None:
    try:
        # Without standalone mode click *returns* the code of a raised click Exit (a failed
        # check's `raise click.exceptions.Exit(1)`) instead of raising it: it must reach sys.exit.
        code = cli.main(args=argv, prog_name="miles", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except MilesError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":
    main()
