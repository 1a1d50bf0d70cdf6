"""Drill instances: what each kind asks, the files it needs, its answer and reference command.

Every kind is generated from a ``random.Random`` and the options alone, so an instance is a
pure function of (options, seed, kind, index). Words are ``[a-z]+`` and file names are fixed,
so nothing here ever needs shell quoting.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_env_terminal_tasks.drills.options import DrillOptions

SYSTEM_PROMPT = (
    "You are an agent in a Linux shell sandbox; the working directory is /app. "
    "Run commands with the bash tool. When asked a question, reply with just the answer."
)
WRITE_NAMES = ("notes.txt", "out.txt", "word.txt", "hello.txt", "msg.txt", "answer.txt")
DATA_NAMES = ("data.txt", "words.txt", "list.txt", "input.txt", "log.txt", "items.txt")
TOKEN_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
TOKEN_DIGITS = "23456789"
ANSWER_KINDS = frozenset({"calc", "count", "grep"})
DIFFICULTY = {"echo": "easy", "write-file": "easy", "calc": "medium", "count": "medium", "grep": "medium"}


@dataclass
class Instance:
    """One generated drill.

    :param answer: the expected final answer (calc, count, grep), else ``None``.
    :param files: files (name relative to the workdir → text) written into the sandbox at setup.
    :param params: the generated values (word, operands, file lines, token, ...).
    """

    kind: str
    instruction: str
    answer: str | None
    reference_command: str
    files: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def difficulty(self) -> str:
        return DIFFICULTY[self.kind]


def _operand(rng: random.Random, opts: DrillOptions) -> int:
    digits = rng.randint(opts.operand_digits_min, opts.operand_digits_max)
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def apply_op(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _lines(rng: random.Random, pool: tuple[str, ...], opts: DrillOptions) -> list[str]:
    n = rng.randint(opts.file_lines_min, opts.file_lines_max)
    return [" ".join(rng.choice(pool) for _ in range(rng.randint(2, 5))) for _ in range(n)]


def make_echo(rng: random.Random, opts: DrillOptions) -> Instance:
    word = rng.choice(opts.word_pool())
    return Instance("echo", f"Print the word {word} using the bash tool.", None, f"echo {word}", params={"word": word})


def make_calc(rng: random.Random, opts: DrillOptions) -> Instance:
    a, b = _operand(rng, opts), _operand(rng, opts)
    op = rng.choice(opts.calc_ops)
    value = apply_op(a, op, b)
    return Instance(
        "calc",
        f"What is {a} {op} {b}? Compute it with the bash tool, then reply with just the number.",
        str(value),
        f"echo $(({a} {op} {b}))",
        params={"a": a, "b": b, "op": op, "value": value},
    )


def make_write_file(rng: random.Random, opts: DrillOptions) -> Instance:
    name, word = rng.choice(WRITE_NAMES), rng.choice(opts.word_pool())
    return Instance(
        "write-file",
        f"Create a file named {name} containing the word {word}.",
        None,
        f"echo {word} > {name}",
        params={"path": name, "word": word},
    )


def make_count(rng: random.Random, opts: DrillOptions) -> Instance:
    lines = _lines(rng, opts.word_pool(), opts)
    name, unit = rng.choice(DATA_NAMES), rng.choice(("lines", "words"))
    n_lines, n_words = len(lines), sum(len(line.split()) for line in lines)
    value = n_lines if unit == "lines" else n_words
    flag = "-l" if unit == "lines" else "-w"
    return Instance(
        "count",
        f"How many {unit} are in the file {name}? Reply with just the number.",
        str(value),
        f"wc {flag} < {name}",
        files={name: "".join(line + "\n" for line in lines)},
        params={"path": name, "unit": unit, "lines": lines, "n_lines": n_lines, "n_words": n_words},
    )


def make_grep(rng: random.Random, opts: DrillOptions) -> Instance:
    lines = _lines(rng, opts.word_pool(), opts)
    token = (rng.choice(TOKEN_LETTERS) + rng.choice(TOKEN_LETTERS) + rng.choice(TOKEN_DIGITS)
             + rng.choice(TOKEN_LETTERS))
    at = rng.randrange(len(lines))
    words = lines[at].split()
    words.insert(rng.randint(0, len(words)), token)
    lines[at] = " ".join(words)
    name = rng.choice(DATA_NAMES)
    return Instance(
        "grep",
        f"Which line of the file {name} contains {token}? Reply with just that line.",
        lines[at],
        f"grep -F {token} {name}",
        files={name: "".join(line + "\n" for line in lines)},
        params={"path": name, "token": token, "lines": lines, "index": at},
    )


MAKERS: dict[str, Callable[[random.Random, DrillOptions], Instance]] = {
    "echo": make_echo,
    "calc": make_calc,
    "write-file": make_write_file,
    "count": make_count,
    "grep": make_grep,
}


def make_instance(kind: str, rng: random.Random, opts: DrillOptions) -> Instance:
    return MAKERS[kind](rng, opts)
