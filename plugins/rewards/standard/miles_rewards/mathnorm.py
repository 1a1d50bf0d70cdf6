"""Math answers: extraction from a model's text, normalisation, numeric comparison with tolerance.

Extraction (:func:`extract_answer`): the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced
braces), else the last ``#### x`` / ``answer is x`` / ``Answer: x``, else the last number.

Normalisation (:func:`normalize`): math delimiters, ``\\left``/``\\right``, spacing commands,
``\\text{...}`` units, degrees, percent and dollar signs, thousands separators, a leading
``x =``, trailing words (units) after a number and a final period are removed; ``\\dfrac`` /
``\\tfrac`` / ``\\frac{a}{b}`` / ``\\frac12`` become ``(a)/(b)``.

Comparison (:func:`answers_match`): when both sides evaluate to numbers (integers, decimals with
any trailing zeros, scientific notation, fractions, ``\\sqrt``, ``\\pi``, + - * / ^ and
parentheses — evaluated by a small safe evaluator, never ``eval``) they match within
``rel_tol``/``abs_tol``; otherwise the normalised strings must be equal (case and spaces ignored).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction

MAX_ANSWER_CHARS = 400
SCAN_CHARS = 20_000  # the answer sits at the end: older text is not scanned (bounds the work)
MAX_GROUP_CHARS = 2_000
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_MARKERS = (re.compile(r"####\s*([^\n]+)"), re.compile(r"answer is[:\s]*([^\n]+)", re.IGNORECASE),
            re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE))
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the ``{...}`` group opening at ``text[start]``, and the index after it."""
    depth = 0
    for i in range(start, min(len(text), start + MAX_GROUP_CHARS)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    found: str | None = None
    for m in _BOX.finditer(text):
        end = m.end()
        if end < len(text) and text[end] == "{":
            group = _braced(text, end)
            if group is not None:
                found = group[0]
        else:  # \boxed 5
            token = re.match(r"[^\s$]+", text[end:])
            if token:
                found = token.group(0)
    return found


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer in ``text``: ``mode`` is ``auto`` (boxed → marker → last number), ``boxed`` or ``last_number``."""
    text = text[-SCAN_CHARS:]
    if mode in ("auto", "boxed"):
        boxed = last_boxed(text)
        if boxed is not None or mode == "boxed":
            return boxed
        for marker in _MARKERS:
            hits = marker.findall(text)
            if hits and hits[-1].strip():
                return hits[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _unfrac(s: str) -> str:
    """``\\frac{a}{b}`` → ``(a)/(b)`` (nested), ``\\frac12`` → ``(1)/(2)``."""
    out, i = [], 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        k = j + 5
        parts: list[str] = []
        for _ in range(2):
            while k < len(s) and s[k] == " ":
                k += 1
            if k < len(s) and s[k] == "{":
                group = _braced(s, k)
                if group is None:
                    return "".join(out) + s[j:]
                parts.append(_unfrac(group[0]))
                k = group[1]
            elif k < len(s):
                parts.append(s[k])
                k += 1
        if len(parts) < 2:
            return "".join(out) + s[j:]
        out.append(f"({parts[0]})/({parts[1]})")
        i = k


def normalize(answer: str) -> str:
    s = answer.strip()[:MAX_ANSWER_CHARS]
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                 ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", ""), ("~", ""),
                 ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("°", ""), ("\\(", ""), ("\\)", ""),
                 ("\\[", ""), ("\\]", ""), ("\\displaystyle", ""), ("\\cdot", "*"), ("\\times", "*")):
        s = s.replace(a, b)
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    # \text{cm} after a number is a unit: drop it; a whole-answer \text{...} is unwrapped
    s = re.sub(r"(?<=[\d}])\s*\\(?:text|mathrm|textbf|mbox)\{[^{}]*\}", "", s)
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox|mathbf)\{([^{}]*)\}", r"\1", s)
    s = _unfrac(s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s.strip())
    s = re.sub(r"(?<=\d),(?=\d{3}(?:\D|$))", "", s)
    s = re.sub(r"^([-+]?[\d.]+(?:/\d+)?)\s*[a-zA-Z][a-zA-Z ]*$", r"\1", s)  # "12 apples", "5 cm"
    s = s.rstrip(".").strip()
    if re.fullmatch(r"\(\s*([A-Za-z])\s*\)", s):  # multiple choice "(B)"
        s = s.strip("() ")
    return s


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _evaluate(node: ast.AST) -> Fraction | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 64 or abs(left) > 1e12:
                raise ValueError("exponent too large")
            if isinstance(right, Fraction) and right.denominator != 1 or isinstance(right, float):
                if left < 0:
                    raise ValueError("fractional power of a negative number")
                return float(left) ** float(right)
        return _BINOPS[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt"
            and len(node.args) == 1 and not node.keywords):
        value = _evaluate(node.args[0])
        if value < 0:
            raise ValueError("square root of a negative number")
        return math.sqrt(value)
    raise ValueError(f"not a number expression: {type(node).__name__}")


def to_number(normalized: str) -> Fraction | float | None:
    """The value of a normalised answer, or ``None`` when it is not a plain number expression."""
    s = normalized.replace(" ", "")
    if not s or len(s) > 200 or not re.search(r"\d|\\pi", s):
        return None
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = re.sub(r"\\sqrt(\d)", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("{", "(").replace("}", ")").replace("^", "**")
    s = re.sub(r"(?<=[\d)])(?=pi|sqrt|\()", "*", s)  # implicit products: 2pi, 3sqrt(2), 2(3)
    if not re.fullmatch(r"[\d.+\-*/()eapiqrst]*", s):
        return None
    try:
        value = _evaluate(ast.parse(s, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError, MemoryError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def answers_match(predicted: str, reference: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    pred, ref = normalize(predicted), normalize(reference)
    a, b = to_number(pred), to_number(ref)
    if a is not None and b is not None:
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            if a == b:
                return True
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)
    return pred.replace(" ", "").lower() == ref.replace(" ", "").lower() and bool(pred)
