"""Test helpers: Harbor task directories built on the fly, and a dict-backed fake sandbox.

The fake understands exactly the shell commands the plugin issues (mkdir/rm, the reward probe,
tail, the path-kind probe) and runs *scripts* (``bash /tests/test.sh``, ``bash /solution/solve.sh``)
by calling a Python stand-in registered for the script path — enough to test the verification
protocol (ordering, stale files, visibility, parsing). Real bash runs in the end-to-end tests on
the local sandbox.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_engine.sandbox.protocol import ExecResult, SandboxSpec

Script = Callable[["FakeSandbox", dict[str, str]], "ExecResult | str | None"]

DEFAULT_TOML = """\
schema_version = "1.4"

[metadata]
difficulty = "easy"
category = "files"
tags = ["demo"]

[verifier]
timeout_sec = 20.0

[agent]
timeout_sec = 30.0
"""

TEST_SH = """\
#!/bin/bash
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""

SOLVE_SH = "#!/bin/bash\necho 42 > /app/answer.txt\n"


def make_task(root: Path, name: str = "answer", *, toml: str | None = DEFAULT_TOML,
              instruction: str | None = "Write 42 to /app/answer.txt.\n", test_sh: str | None = TEST_SH,
              solve_sh: str | None = SOLVE_SH, files: dict[str, str] | None = None) -> Path:
    """Write a Harbor task directory; ``None`` leaves a part out."""
    task = root / name
    task.mkdir(parents=True, exist_ok=True)
    if toml is not None:
        (task / "task.toml").write_text(textwrap.dedent(toml))
    if instruction is not None:
        (task / "instruction.md").write_text(instruction)
    if test_sh is not None:
        (task / "tests").mkdir(exist_ok=True)
        (task / "tests" / "test.sh").write_text(test_sh)
    if solve_sh is not None:
        (task / "solution").mkdir(exist_ok=True)
        (task / "solution" / "solve.sh").write_text(solve_sh)
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
        self.dirs: set[str] = set()
        self.scripts = dict(scripts or {})
        self.calls: list[dict[str, Any]] = []
        self.closed = 0

    # -- helpers for tests ---------------------------------------------------------------
    def text(self, path: str) -> str | None:
        data = self.files.get(path)
        return None if data is None else data.decode()

    def under(self, prefix: str) -> list[str]:
        return sorted(p for p in self.files if p.startswith(prefix.rstrip("/") + "/"))

    def commands(self) -> list[str]:
        return [c["cmd"] for c in self.calls]

    def _is_dir(self, path: str) -> bool:
        return path in self.dirs or bool(self.under(path))

    # -- the protocol --------------------------------------------------------------------
    async def exec(self, cmd: Any, *, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_s: float | None = None, stdin: bytes | None = None,
                   max_output_bytes: int | None = None, user: str | None = None) -> ExecResult:
        assert not self.closed, "exec on a closed sandbox"
        self.calls.append({"cmd": cmd, "env": dict(env or {}), "timeout_s": timeout_s, "user": user})
        if m := re.fullmatch(r"bash (\S+)(?: > (\S+) 2>&1)?", cmd):
            return self._script(m.group(1), m.group(2), dict(env or {}))
        if m := re.fullmatch(r"for f in (.+?); do .*", cmd):
            return ExecResult(0, "".join(f"{p}\n" for p in m.group(1).split() if p in self.files), "")
        if m := re.fullmatch(r"tail -c (\d+) (\S+).*", cmd):
            return ExecResult(0, (self.text(m.group(2)) or "")[-int(m.group(1)):], "")
        if m := re.fullmatch(r"if \[ -d (\S+) \]; then .*", cmd):
            path = m.group(1)
            return ExecResult(0, "dir\n" if self._is_dir(path) else "file\n" if path in self.files else "none\n", "")
        for part in cmd.split(" && "):
            words = part.split()
            if words[:2] == ["mkdir", "-p"]:
                self.dirs.update(words[2:])
            elif words[:2] == ["rm", "-f"]:
                for p in words[2:]:
                    self.files.pop(p, None)
            else:
                raise AssertionError(f"FakeSandbox does not understand {cmd!r}")
        return ExecResult(0, "", "")

    def _script(self, path: str, redirect: str | None, env: dict[str, str]) -> ExecResult:
        if path not in self.files:
            out = ExecResult(127, "", f"bash: {path}: No such file or directory\n")
        else:
            handler = self.scripts.get(path)
            got = handler(self, env) if handler else None
            out = got if isinstance(got, ExecResult) else ExecResult(0, got or "", "")
        if redirect:
            self.files[redirect] = (out.stdout + out.stderr).encode()
            return ExecResult(out.exit_code, "", "", timed_out=out.timed_out)
        return out

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path][:max_bytes]

    async def upload_dir(self, local: Path, remote: str) -> None:
        for f in Path(local).rglob("*"):
            if f.is_file():
                self.files[f"{remote.rstrip('/')}/{f.relative_to(local).as_posix()}"] = f.read_bytes()

    async def download_dir(self, remote: str, local: Path) -> None:
        for path in self.under(remote):
            target = Path(local) / path[len(remote.rstrip("/")) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.files[path])

    async def alive(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed += 1

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class FakeFactory:
    """``ctx.info["sandbox_factory"]``: creates fresh fakes sharing the script stand-ins."""

    def __init__(self, scripts: dict[str, Script]) -> None:
        self.scripts = scripts
        self.created: list[FakeSandbox] = []

    async def __call__(self, spec: SandboxSpec) -> FakeSandbox:
        sb = FakeSandbox(spec, self.scripts)
        self.created.append(sb)
        return sb


def answer_check(sb: FakeSandbox, env: dict[str, str]) -> str:
    """Python stand-in for :data:`TEST_SH`."""
    ok = (sb.text("/app/answer.txt") or "").strip() == "42"
    sb.files["/logs/verifier/reward.txt"] = b"1\n" if ok else b"0\n"
    return "checked\n"


def write_answer(sb: FakeSandbox, env: dict[str, str]) -> str:
    """Python stand-in for :data:`SOLVE_SH`."""
    sb.files["/app/answer.txt"] = b"42\n"
    return ""


DEFAULT_SCRIPTS: dict[str, Script] = {"/tests/test.sh": answer_check, "/solution/solve.sh": write_answer}
