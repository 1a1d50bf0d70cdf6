"""Packaged row generators: a data set written to a JSONL at start-up, identical for the same options."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from miles_env_dataset.options import GenerateOptions

NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
THINGS = ("apples", "books", "coins", "shells", "stamps", "cards", "pens", "eggs")


def arithmetic_rows(options: GenerateOptions) -> list[dict]:
    rng = random.Random(f"miles-arithmetic:{options.seed}")
    rows = []
    for i in range(options.rows):
        name, thing, op = rng.choice(NAMES), rng.choice(THINGS), rng.choice(options.ops)
        a, b = rng.randint(1, options.max_operand), rng.randint(1, options.max_operand)
        if op == "sub" and b > a:
            a, b = b, a
        if op == "add":
            q, ans = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
        else:
            q, ans = f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?", a - b
        rows.append({"task_id": f"arith-{options.seed}-{i:06d}", "prompt": q, "answer": ans, "op": op})
    return rows


def write_generated(path: Path, options: GenerateOptions) -> bool:
    """Write the rows to ``path`` atomically unless it already holds exactly them; True if written."""
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in arithmetic_rows(options))
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return True
