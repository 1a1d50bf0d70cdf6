"""Where each key of a TOML file is: ``tomllib`` keeps no positions, and an error should name the line."""

from __future__ import annotations

import re

_TABLE_RE = re.compile(r"^\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(r"""^((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _norm_key(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def toml_key_lines(text: str) -> dict[str, int]:
    """Best-effort ``{dotted.key: line}`` for error messages (tomllib keeps no positions)."""
    lines: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if m := _TABLE_RE.match(stripped):
            table = _norm_key(m.group(1))
            lines.setdefault(table, number)
        elif m := _KEY_RE.match(stripped):
            key = _norm_key(m.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines
