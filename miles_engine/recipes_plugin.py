"""Built-in plugin registering the packaged recipes (YAML files shipped as package data)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from miles_engine import hookimpl
from miles_engine.components import RecipeFile


def _first_comment(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


@hookimpl
def miles_register_recipes() -> list[RecipeFile]:
    root = Path(str(files("miles_engine.recipes")))
    return [
        RecipeFile(name=p.stem, path=p, description=_first_comment(p))
        for p in sorted(root.glob("*.yaml"))
    ]
