"""Test helpers: terminal-bench task directories built on the fly, and a dict-backed fake sandbox.

The fake understands the few shell commands the plugin issues and runs scripts
(``bash /tests/run-tests.sh``, ``bash /solution/solution.sh``, ``bash -s``) by calling a Python
stand-in registered for the script. Real bash and real pytest run in the end-to-end tests.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_engine.sandbox.protocol import ExecResult, SandboxSpec

Script = Callable[["FakeSandbox", dict[str, Any]], "ExecResult | str | None"]

TASK_YAML = """\
instruction: |
  Write 42 to /app/answer.txt.
author_name: Ada
difficulty: easy
category: file-operations
tags: [files, demo]
parser_name: pytest
max_agent_timeout_sec: 50
max_test_timeout_sec: 20
run_tests_in_same_shell: false
"""

RUN_TESTS_SH = """\
#!/bin/bash
python3 -m pytest -rA "$TEST_DIR/test_outputs.py"
"""

TEST_OUTPUTS = """\
from pathlib import Path


def test_answer():
    assert Path("/app/answer.txt").read_text().strip() == "42"
"""

SOLUTION_SH = "#!/bin/bash\necho 42 > /app/answer.txt\n"


def make_tb_task(root: Path, name: str = "answer", *, task_yaml: str | None = TASK_YAML,
                 run_tests: str | None = RUN_TESTS_SH, tests: dict[str, str] | None = None,
                 solution_sh: str | None = SOLUTION_SH, files: dict[str, str] | None = None) -> Path:
    task = root / name
    task.mkdir(parents=True, exist_ok=True)
    if task_yaml is not None:
        (task / "task.yaml").write_text(textwrap.dedent(task_yaml))
    if run_tests is not None:
        (task / "run-tests.sh").write_text(run_tests)
    for rel, content in ({"test_outputs.py": TEST_OUTPUTS} if tests is None else tests).items():
        (task / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / "tests" / rel).write_text(content)
    if solution_sh is not None:
        (task / "solution.sh").write_text(solution_sh)
    for rel, content in (files or {}).items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(content)
    return task


class FakeSandbox:
    isolation = "process"

    def __init__(self, spec: SandboxSpec | None = None, scripts: dict[str, Script] | None = None) -> None:
        self.id = "fake"
        self.spec = spec
        self.files: dict[str, bytes] = {}
        self.scripts = dict(scripts or {})
        self.calls: list[dict[str, Any]] = []
        self.closed = 0

    def text(self, path: str) -> str | None:
        data = self.files.get(path)
        return None if data is None else data.decode()

    def under(self, prefix: str) -> list[str]:
        return sorted(p for p in self.files if p.startswith(prefix.rstrip("/") + "/"))

    def commands(self) -> list[str]:
        return [c["cmd"] for c in self.calls]

    async def exec(self, cmd: Any, *, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_s: float | None = None, stdin: bytes | None = None,
                   max_output_bytes: int | None = None, user: str | None = None) -> ExecResult:
        call = {"cmd": cmd, "env": dict(env or {}), "timeout_s": timeout_s, "stdin": stdin}
        self.calls.append(call)
        if m := re.fullmatch(r"bash (\S+)(?: > (\S+) 2>&1)?", cmd):
            return self._script(m.group(1), m.group(2), call)
        if m := re.fullmatch(r"tail -c (\d+) (\S+)", cmd):
            return ExecResult(0, (self.text(m.group(2)) or "")[-int(m.group(1)):], "")
        for part in cmd.split(" && "):
            words = part.split()
            if words[:2] == ["rm", "-f"]:
                for p in words[2:]:
                    self.files.pop(p, None)
            elif words[:2] != ["mkdir", "-p"]:
                raise AssertionError(f"FakeSandbox does not understand {cmd!r}")
        return ExecResult(0, "", "")

    def _script(self, path: str, redirect: str | None, call: dict[str, Any]) -> ExecResult:
        if path != "-s" and path not in self.files:
            out = ExecResult(127, "", f"bash: {path}: No such file or directory\n")
        else:
            handler = self.scripts.get(path)
            got = handler(self, call) if handler else None
            out = got if isinstance(got, ExecResult) else ExecResult(0, got or "", "")
        if redirect:
            self.files[redirect] = (out.stdout + out.stderr).encode()
            return ExecResult(out.exit_code, "", "", timed_out=out.timed_out)
        return out

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return self.files[path][:max_bytes]

    async def upload_dir(self, local: Path, remote: str) -> None:
        for f in Path(local).rglob("*"):
            if f.is_file():
                self.files[f"{remote.rstrip('/')}/{f.relative_to(local).as_posix()}"] = f.read_bytes()

    async def download_dir(self, remote: str, local: Path) -> None:
        prefix = remote.rstrip("/") + "/"
        for path, data in self.files.items():
            if path.startswith(prefix):
                target = Path(local) / path[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)

    async def alive(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed += 1

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def pytest_like(passed: int, failed: int) -> str:
    """Console output shaped like ``pytest -rA`` (the real thing is tested in test_tb_parser)."""
    lines = ["============================= test session starts ==============================",
             "=========================== short test summary info ============================"]
    lines += [f"PASSED tests/test_outputs.py::test_ok_{i}" for i in range(passed)]
    lines += [f"FAILED tests/test_outputs.py::test_bad_{i} - AssertionError: nope" for i in range(failed)]
    tally = ", ".join(p for p in (f"{failed} failed" if failed else "", f"{passed} passed" if passed else "") if p)
    lines.append(f"========================= {tally or 'no tests ran'} in 0.02s =========================")
    return "\n".join(lines) + "\n"


def grade_answer(sb: FakeSandbox, call: dict[str, Any]) -> str:
    """Python stand-in for run-tests.sh + test_outputs.py."""
    assert call["env"] == {"TEST_DIR": "/tests"}
    ok = (sb.text("/app/answer.txt") or "").strip() == "42"
    return pytest_like(1 if ok else 0, 0 if ok else 1)


def write_answer(sb: FakeSandbox, call: dict[str, Any]) -> str:
    sb.files["/app/answer.txt"] = b"42\n"
    return ""


DEFAULT_SCRIPTS: dict[str, Script] = {"/tests/run-tests.sh": grade_answer, "/solution/solution.sh": write_answer}
