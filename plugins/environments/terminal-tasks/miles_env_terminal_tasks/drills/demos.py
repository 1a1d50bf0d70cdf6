"""Noisy demonstrations: right and realistically wrong attempts at a drill, without a sandbox.

Each *form* turns an instance into an :class:`Attempt`: the bash command (or none, when the
attempt guesses without the tool), the output that command prints — computed here in Python,
exactly as the sandbox would print it — and the final assistant message. Correct forms vary
the surface (``echo W``, ``printf '%s\\n' W``, ``expr``, ``$(( ))``, ``python3 -c``, ``awk``...);
wrong forms are the mistakes a small policy makes (``cat W``, ``echo W.``, off-by-one answers,
the wrong ``wc`` flag, copying ``grep -n``'s prefix, guessing without calling the tool).
Every wrong form is guaranteed to score 0 and every correct form to score 1.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from miles_engine.environments.protocol import Message, format_exec_observation
from miles_engine.sandbox.protocol import ExecResult

from miles_env_terminal_tasks.drills.kinds import WRITE_NAMES, DATA_NAMES, Instance, apply_op

DEMO_CALL_ID = "call_1"


@dataclass(frozen=True)
class Attempt:
    form: str
    command: str | None  # None: answered without calling the tool
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    answer: str = ""

    def observation(self) -> str:
        """The tool message content, as :func:`format_exec_observation` renders the real run."""
        return format_exec_observation(ExecResult(self.exit_code, self.stdout, self.stderr))

    def messages(self) -> list[Message]:
        """The assistant-side turns: tool call, tool output, final answer (OpenAI messages)."""
        out: list[Message] = []
        if self.command is not None:
            args = json.dumps({"command": self.command})
            call = {"id": DEMO_CALL_ID, "type": "function", "function": {"name": "bash", "arguments": args}}
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            out.append({"role": "tool", "tool_call_id": DEMO_CALL_ID, "content": self.observation()})
        out.append({"role": "assistant", "content": self.answer})
        return out


Form = Callable[[Instance, random.Random, tuple[str, ...]], Attempt]


def _other(rng: random.Random, choices: tuple[str, ...] | list[str], not_this: str) -> str:
    rest = [c for c in choices if c != not_this]
    return rng.choice(rest)


def _near(rng: random.Random, value: int, spread: int = 12) -> int:
    return value + rng.choice([d for d in range(-spread, spread + 1) if d])


# -- echo ---------------------------------------------------------------------------------
def _echo_forms() -> tuple[list[Form], list[Form]]:
    def ok(form: str, cmd: str, out: str) -> Form:
        return lambda i, r, p: Attempt(form, cmd.format(w=i.params["word"]), out.format(w=i.params["word"]),
                                       answer=i.params["word"])

    correct = [ok("echo", "echo {w}", "{w}\n"), ok("echo-dq", 'echo "{w}"', "{w}\n"),
               ok("echo-sq", "echo '{w}'", "{w}\n"),
               ok("printf-s", "printf '%s\\n' {w}", "{w}\n"), ok("printf-nl", "printf '{w}\\n'", "{w}\n"),
               ok("printf", "printf {w}", "{w}"), ok("echo-n", "echo -n {w}", "{w}"),
               ok("python", "python3 -c 'print(\"{w}\")'", "{w}\n"), ok("herestring", "cat <<< {w}", "{w}\n"),
               ok("pipe", "echo {w} | cat", "{w}\n")]

    def w(i: Instance) -> str:
        return i.params["word"]

    wrong: list[Form] = [
        lambda i, r, p: Attempt("cat-word", f"cat {w(i)}", "", f"cat: {w(i)}: No such file or directory\n", 1, w(i)),
        lambda i, r, p: Attempt("ls-word", f"ls {w(i)}", "", f"ls: cannot access '{w(i)}': No such file or directory\n",
                                2, w(i)),
        lambda i, r, p: Attempt("echo-dot", f"echo {w(i)}.", f"{w(i)}.\n", answer=w(i)),
        lambda i, r, p: Attempt("echo-twice", f"echo {w(i)} {w(i)}", f"{w(i)} {w(i)}\n", answer=w(i)),
        lambda i, r, p: Attempt("typo", f"echo {w(i)[:-1]}", f"{w(i)[:-1]}\n", answer=w(i)),
        lambda i, r, p: (lambda o: Attempt("other-word", f"echo {o}", f"{o}\n", answer=o))(_other(r, p, w(i))),
        lambda i, r, p: Attempt("echo-var", f"echo ${w(i)}", "\n", answer=w(i)),
        lambda i, r, p: Attempt("no-tool", None, answer=w(i)),
    ]
    return correct, wrong


# -- calc ---------------------------------------------------------------------------------
def expr_attempt(a: int, op: str, b: int) -> Attempt:
    v = apply_op(a, op, b)
    sym = "\\*" if op == "*" else op
    return Attempt("expr", f"expr {a} {sym} {b}", f"{v}\n", exit_code=1 if v == 0 else 0, answer=str(v))


def _calc_correct(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    a, b, op, v = i.params["a"], i.params["b"], i.params["op"], i.params["value"]
    forms = [expr_attempt(a, op, b),
             Attempt("arith", f"echo $(({a} {op} {b}))", f"{v}\n", answer=str(v)),
             Attempt("arith-tight", f"echo $(({a}{op}{b}))", f"{v}\n", answer=str(v)),
             Attempt("python", f"python3 -c 'print({a} {op} {b})'", f"{v}\n", answer=str(v))]
    if abs(v) < 2**31:
        forms.append(Attempt("awk", f"awk 'BEGIN {{ print {a} {op} {b} }}'", f"{v}\n", answer=str(v)))
    return r.choice(forms)


def _calc_wrong(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    a, b, op, v = i.params["a"], i.params["b"], i.params["op"], i.params["value"]
    right = _calc_correct(i, r, p)
    kind = r.choice(["off-by-one", "swapped-digits", "no-tool-guess", "literal", "echo-literal", "wrong-op"])
    if kind == "swapped-digits":
        s = str(abs(v))
        j = r.randrange(len(s) - 1) if len(s) > 1 else 0
        t = s[:j] + s[j + 1] + s[j] + s[j + 2:] if len(s) > 1 else s
        guess = ("-" if v < 0 else "") + t
        if guess != str(v):
            return Attempt(kind, right.command, right.stdout, right.stderr, right.exit_code, guess)
        kind = "off-by-one"
    if kind == "literal" and op != "*":
        return Attempt(kind, f"expr {a}{op}{b}", f"{a}{op}{b}\n", answer=f"{a}{op}{b}")
    if kind in ("literal", "echo-literal"):
        return Attempt("echo-literal", f'echo "{a} {op} {b}"', f"{a} {op} {b}\n", answer=str(_near(r, v)))
    if kind == "wrong-op":
        other = expr_attempt(a, _other(r, ["+", "-", "*"], op), b)
        if other.answer != str(v):
            return Attempt(kind, other.command, other.stdout, other.stderr, other.exit_code, other.answer)
        kind = "off-by-one"
    if kind == "no-tool-guess":
        return Attempt(kind, None, answer=str(_near(r, v)))
    return Attempt("off-by-one", right.command, right.stdout, right.stderr, right.exit_code, str(v + r.choice([-1, 1])))


# -- write-file ---------------------------------------------------------------------------
def _write_correct(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    w, f = i.params["word"], i.params["path"]
    return r.choice([
        Attempt("echo", f"echo {w} > {f}", answer="done"),
        Attempt("printf", f"printf '%s\\n' {w} > {f}", answer="done"),
        Attempt("printf-bare", f"printf {w} > {f}", answer="done"),
        Attempt("tee", f"echo {w} | tee {f}", f"{w}\n", answer="done"),
        Attempt("herestring", f"cat > {f} <<< {w}", answer="done"),
        Attempt("python", f"python3 -c 'print(\"{w}\", file=open(\"{f}\", \"w\"))'", answer="done"),
    ])


def _write_wrong(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    w, f = i.params["word"], i.params["path"]
    return r.choice([
        Attempt("wrong-name", f"echo {w} > {_other(r, WRITE_NAMES, f)}", answer="done"),
        Attempt("no-redirect", f"echo {w}", f"{w}\n", answer="done"),
        Attempt("touch", f"touch {f}", answer="done"),
        Attempt("extra-dot", f"echo {w}. > {f}", answer="done"),
        Attempt("swapped", f"echo {f} > {w}", answer="done"),
        Attempt("other-word", f"echo {_other(r, p, w)} > {f}", answer="done"),
        Attempt("no-tool", None, answer="done"),
    ])


# -- count --------------------------------------------------------------------------------
def _count_correct(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    f, v = i.params["path"], i.answer
    if i.params["unit"] == "lines":
        forms = [("wc-stdin", f"wc -l < {f}", f"{v}\n"), ("wc-file", f"wc -l {f}", f"{v} {f}\n"),
                 ("cat-wc", f"cat {f} | wc -l", f"{v}\n"), ("awk-nr", f"awk 'END {{ print NR }}' {f}", f"{v}\n"),
                 ("grep-c", f"grep -c '' {f}", f"{v}\n"),
                 ("python", f"python3 -c 'print(len(open(\"{f}\").readlines()))'", f"{v}\n")]
    else:
        forms = [("wc-stdin", f"wc -w < {f}", f"{v}\n"), ("wc-file", f"wc -w {f}", f"{v} {f}\n"),
                 ("cat-wc", f"cat {f} | wc -w", f"{v}\n"),
                 ("awk-nf", f"awk '{{ n += NF }} END {{ print n }}' {f}", f"{v}\n"),
                 ("python", f"python3 -c 'print(len(open(\"{f}\").read().split()))'", f"{v}\n")]
    form, cmd, out = r.choice(forms)
    return Attempt(form, cmd, out, answer=str(v))


def _count_wrong(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    f, v = i.params["path"], int(i.answer or 0)
    lines_q = i.params["unit"] == "lines"
    other_flag, other_v = ("-w", i.params["n_words"]) if lines_q else ("-l", i.params["n_lines"])
    content = i.files[f]
    missing = _other(r, DATA_NAMES, f)
    right = _count_correct(i, r, p)
    return r.choice([
        Attempt("wrong-unit", f"wc {other_flag} < {f}", f"{other_v}\n", answer=str(other_v)),
        Attempt("bytes", f"wc -c < {f}", f"{len(content)}\n", answer=str(len(content))),
        Attempt("off-by-one", right.command, right.stdout, answer=str(v + r.choice([-1, 1]))),
        Attempt("cat-miscount", f"cat {f}", content, answer=str(v + r.choice([-2, -1, 1, 2]))),
        Attempt("wrong-file", f"wc -l {missing}", "", f"wc: {missing}: No such file or directory\n", 1, "0"),
        Attempt("no-tool-guess", None, answer=str(r.choice([x for x in range(1, 2 * v + 2) if x != v]))),
    ])


# -- grep ---------------------------------------------------------------------------------
def _grep_correct(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    t, f, line, k = i.params["token"], i.params["path"], i.answer or "", i.params["index"] + 1
    form, cmd, out = r.choice([
        ("grep", f"grep {t} {f}", f"{line}\n"), ("grep-F", f"grep -F {t} {f}", f"{line}\n"),
        ("grep-n", f"grep -n {t} {f}", f"{k}:{line}\n"), ("awk", f"awk '/{t}/' {f}", f"{line}\n"),
        ("sed", f"sed -n '/{t}/p' {f}", f"{line}\n"), ("grep-w", f"grep -w {t} {f}", f"{line}\n"),
    ])
    return Attempt(form, cmd, out, answer=line)


def _grep_wrong(i: Instance, r: random.Random, p: tuple[str, ...]) -> Attempt:
    t, f, line, at = i.params["token"], i.params["path"], i.answer or "", i.params["index"]
    lines: list[str] = i.params["lines"]
    others = [x for j, x in enumerate(lines) if j != at]
    near = lines[at + 1] if at + 1 < len(lines) else lines[at - 1]
    return r.choice([
        Attempt("grep-count", f"grep -c {t} {f}", "1\n", answer="1"),
        Attempt("grep-v", f"grep -v {t} {f}", "".join(x + "\n" for x in others), answer=others[0]),
        Attempt("token-only", f"grep -o {t} {f}", f"{t}\n", answer=t),
        Attempt("with-number", f"grep -n {t} {f}", f"{at + 1}:{line}\n", answer=f"{at + 1}:{line}"),
        Attempt("lowercase", f"grep {t.lower()} {f}", "", "", 1, "not found"),
        Attempt("neighbour", f"grep -F {t} {f}", f"{line}\n", answer=near),
        Attempt("no-tool-guess", None, answer=r.choice(others)),
    ])


_ECHO_CORRECT, _ECHO_WRONG = _echo_forms()
CORRECT: dict[str, Form] = {
    "echo": lambda i, r, p: r.choice(_ECHO_CORRECT)(i, r, p),
    "calc": _calc_correct, "write-file": _write_correct, "count": _count_correct, "grep": _grep_correct,
}
WRONG: dict[str, Form] = {
    "echo": lambda i, r, p: r.choice(_ECHO_WRONG)(i, r, p),
    "calc": _calc_wrong, "write-file": _write_wrong, "count": _count_wrong, "grep": _grep_wrong,
}


def attempt(instance: Instance, rng: random.Random, pool: tuple[str, ...], *, wrong: bool,
            no_tool_share: float | None = None) -> Attempt:
    """One right (``wrong=False``) or deliberately wrong attempt at ``instance``.

    ``no_tool_share`` (wrong attempts only): the probability that the mistake is answering
    without calling bash; ``None`` draws it as often as any other wrong form.
    """
    if not wrong:
        return CORRECT[instance.kind](instance, rng, pool)
    if no_tool_share is None:
        return WRONG[instance.kind](instance, rng, pool)
    want_tool = rng.random() >= no_tool_share
    for _ in range(1000):  # every kind has both tool-using and tool-less mistakes
        att = WRONG[instance.kind](instance, rng, pool)
        if (att.command is not None) == want_tool:
            return att
    raise AssertionError(f"no {'tool-using' if want_tool else 'tool-less'} mistake for kind {instance.kind}")
