"""The house has floors: a package imports only packages on floors below its own, never one beside
or above it, and no import cycle exists outside the friend modules listed here.

Every import of every module counts: top-level ones, those inside functions (they hide arrows as
well as any) and ``TYPE_CHECKING`` ones. The picture and the rule for new code are in
docs/architecture.md; this file is the one place the order is written.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = "miles_engine"
ROOT = Path(__file__).resolve().parents[2]

# Top to bottom. A package may import its own modules and the packages of any lower floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("run",),  # every program's composition root
    ("config", "testing", "scaffold", "dashboard"),  # the recipe root; plugin authors' contract suites and
    # templates; `miles dashboard` (reads run directories: metrics, report, evaluation records)
    ("teachers",),
    ("evaluation", "sft"),
    ("checkpoint", "cluster", "data", "report"),
    ("trainer", "tito", "metrics"),
    ("rollout",),
    ("agents", "rewards", "weights"),
    ("engines", "environments"),
    ("hub",),
    ("models", "sandbox", "hookspecs", "loader", "recipes_plugin"),
    ("precision",),  # the quantizer every stage shares, loading a model included
    ("batch_invariant", "fastapi_app", "components", "errors", PACKAGE),  # PACKAGE: miles_engine/__init__.py
)

# Friend modules: one class carved into files under 400 lines, the helpers naming the host class in
# annotations only (TYPE_CHECKING). These are the only cycles allowed.
FRIENDS: tuple[frozenset[str], ...] = (
    frozenset({"sandbox.local.backend", "sandbox.local.fileops", "sandbox.local.sandbox", "sandbox.local.teardown"}),
    frozenset({"trainer.rl_step", "trainer.torch_trainer"}),
    frozenset({"trainer.megatron.dist_checkpoint", "trainer.megatron.pipeline", "trainer.megatron.state",
               "trainer.megatron.trainer"}),
)


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, typing only)`` for every import of ``miles_engine`` in ``path``."""
    found: list[tuple[str, int, bool]] = []

    def resolve(name: str) -> str:
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        return name

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [f"{child.module}.{a.name}" for a in child.names]
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    found.append((resolve(name), child.lineno, typing_only))
            visit(child, typing_only or (isinstance(child, ast.If) and _type_checking(child)))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return found


def floor_of() -> dict[str, int]:
    return {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def check(root: Path) -> list[str]:
    """Every violation as ``file:line: rule``: an unplaced package, an import that does not run
    down, a cycle that is not a listed friend group."""
    known = modules(root)
    floors, problems = floor_of(), []
    graph: dict[str, set[str]] = defaultdict(set)
    lines: dict[tuple[str, str], str] = {}
    for module, path in known.items():
        src = package_of(module)
        where = path.relative_to(root)
        if src not in floors:
            problems.append(f"{where}: package '{src}' is on no floor; add it to FLOORS in {Path(__file__).name}")
            continue
        for target, line, _typing_only in imports(path, known):
            dst = package_of(target)
            if target == module:
                continue
            graph[module].add(target)
            lines.setdefault((module, target), f"{where}:{line}")
            if dst == src or dst not in floors:
                continue
            if floors[dst] <= floors[src]:
                side = "beside" if floors[dst] == floors[src] else "above"
                problems.append(f"{where}:{line}: {module} imports {target}: '{dst}' is {side} '{src}' "
                                f"(floors: {' > '.join('|'.join(f) for f in FLOORS)})")
    for group in cycles(graph):
        short = frozenset(m.removeprefix(PACKAGE + ".") for m in group)
        if short not in FRIENDS:
            arrows = sorted(f"{lines[(a, b)]}: {a} -> {b}" for a in group for b in graph[a] if b in group)
            problems.append("import cycle among " + ", ".join(sorted(group)) + ":\n    " + "\n    ".join(arrows))
    return problems


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(group)
    return out


def test_every_import_runs_down_the_floors_and_no_cycle_but_the_friend_modules() -> None:
    problems = check(ROOT)
    assert not problems, "the layering is broken:\n" + "\n".join(problems)


def test_every_floor_names_a_package_that_exists() -> None:
    present = {package_of(m) for m in modules(ROOT)}
    assert set(floor_of()) == present, f"FLOORS lists {sorted(set(floor_of()) - present)} (gone) and misses " \
                                       f"{sorted(present - set(floor_of()))}"
    for group in FRIENDS:
        missing = {m for m in group if f"{PACKAGE}.{m}" not in modules(ROOT)}
        assert not missing, f"friend modules {sorted(missing)} no longer exist: update FRIENDS"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("where", ["top", "function", "typing"])
def test_a_planted_import_that_runs_back_up_fails_naming_file_line_and_rule(tmp_path: Path, where: str) -> None:
    body = {"top": "from miles_engine.run import compose\n",
            "function": "def f():\n    from miles_engine.run.compose import compose\n",
            "typing": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles_engine.run import compose\n"}
    root = _tree(tmp_path, {"__init__.py": "", "run/__init__.py": "", "run/compose.py": "",
                            "models/__init__.py": "", "models/source.py": body[where]})
    [problem] = check(root)
    line = {"top": 1, "function": 2, "typing": 3}[where]
    assert problem.startswith(f"{PACKAGE}/models/source.py:{line}: miles_engine.models.source imports "
                              f"miles_engine.run.compose: 'run' is above 'models'"), problem


def test_an_import_beside_a_new_cycle_and_an_unplaced_package_fail(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "evaluation/__init__.py": "from miles_engine.sft import x\n",
                            "sft/__init__.py": "", "sft/x.py": "",
                            "rollout/__init__.py": "", "rollout/a.py": "from miles_engine.rollout import b\n",
                            "rollout/b.py": "def f():\n    from miles_engine.rollout import a\n",
                            "newpkg/__init__.py": ""})
    problems = check(root)
    assert any("'sft' is beside 'evaluation'" in p for p in problems), problems
    assert any(p.startswith("import cycle among miles_engine.rollout.a, miles_engine.rollout.b")
               and "rollout/b.py:2: miles_engine.rollout.b -> miles_engine.rollout.a" in p for p in problems), problems
    assert any("package 'newpkg' is on no floor" in p for p in problems), problems
    assert len(problems) == 3, problems
