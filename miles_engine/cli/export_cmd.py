"""``miles export RUN_DIR [--merged] DEST``."""

from __future__ import annotations

import click

from miles_engine.checkpoint.export import export_run


@click.command("export")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path())
@click.option("--merged", is_flag=True,
              help="LoRA runs: merge the adapters into the base weights (a plain HF model directory); "
                   "without it a peft adapter directory is written. Full fine-tuning always exports merged.")
def export(run_dir: str, dest: str, merged: bool) -> None:
    """Write RUN_DIR's newest checkpoint to DEST as a Hugging Face directory (with the tokenizer)."""
    path = export_run(run_dir, dest, merged=merged)
    click.echo(f"exported {run_dir} to {path}")
