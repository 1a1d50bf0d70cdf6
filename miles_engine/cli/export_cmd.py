"""``miles export RUN_DIR [--merged] [--format F] DEST`` and ``miles convert SRC DEST --format F``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import click

from miles_engine.checkpoint.export import export_run, save_model
from miles_engine.errors import ConfigError

FORMATS = ("full", "fp8", "mxfp8", "nvfp4", "int4")


@click.command("export")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path())
@click.option("--merged", is_flag=True,
              help="LoRA runs: merge the adapters into the base weights (a plain HF model directory); "
                   "without it a peft adapter directory is written. Full fine-tuning always exports merged.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="the weights' format (default: the run's precision.rollout, what its engines served; fp8 is "
                   "Hugging Face's fine-grained FP8 layout, which vLLM and SGLang load)")
def export(run_dir: str, dest: str, merged: bool, fmt: str | None) -> None:
    """Write RUN_DIR's newest checkpoint to DEST as a Hugging Face directory (with the tokenizer)."""
    path = export_run(run_dir, dest, merged=merged, fmt=fmt)
    click.echo(f"exported {run_dir} to {path}")


@click.command("convert")
@click.argument("source")
@click.argument("dest", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(FORMATS[1:]), required=True, help="the quantised format")
@click.option("--exception", "exceptions", multiple=True,
              help="weight names (fnmatch) kept in high precision, as precision.exceptions; repeatable")
def convert(source: str, dest: str, fmt: str, exceptions: tuple[str, ...]) -> None:
    """Write the model SOURCE (an HF directory, a .gguf file, package:...) to DEST in a quantised format."""
    from miles_engine.models.loading import load_model

    out = Path(dest)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise ConfigError(f"convert destination {out} exists and is not empty")
    model, _ = load_model(source, dtype="float32")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model(model, tmp, fmt, exceptions)
        src = Path(source)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if src.is_dir() and (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        if out.is_dir():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    click.echo(f"converted {source} to {out} ({fmt})")
