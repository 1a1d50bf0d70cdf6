"""The sandbox contract suite: the protocol's semantics, checked against any backend.

A plugin's tests subclass :class:`SandboxContract` and implement :meth:`make_backend`::

    from miles_engine.testing.sandbox import SandboxContract

    class TestMyBackendContract(SandboxContract):
        def make_backend(self):  # or make_backend(self, request) to use other fixtures
            return MyBackend(MyOptions())

Every ``test_*`` method below then runs against that backend. All tests of one class share
one backend and one event loop (so a backend may bind clients to its loop); ``aclose`` runs
once at the end. Class attributes tune the run:

- ``spec_overrides``: extra :class:`SandboxSpec` fields (e.g. ``{"image": "python:3.12"}``).
- ``exercise_*``: set ``False`` to skip an optional behaviour the backend does not offer.
- ``case_timeout_s``: bound on each test's sandbox work.
- :meth:`labels_of`: return a live sandbox's labels as the provider stores them, so the
  label test can check them (the default skips it).

A backend that is :class:`~miles_engine.sandbox.protocol.SweepableBackend` also runs the
sweep tests. The suite needs ``bash`` and coreutils in the sandbox's default image.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from miles_engine.errors import SandboxError, SandboxUnsupportedError
from miles_engine.sandbox.protocol import (
    ISOLATION_ORDER,
    RUN_LABEL,
    ExecResult,
    NetworkPolicy,
    Resources,
    Sandbox,
    SandboxBackend,
    SweepableBackend,
)
from miles_engine.testing.sandbox_harness import ContractHarness

BINARY = bytes(range(256)) * 3 + b"\x00\r\n\xff\xfe"


class SandboxContract(ContractHarness):
    """Base class of a backend's contract tests (see the module docstring)."""

    # ------------------------------------------------------------------ lifecycle
    def test_backend_shape(self, sandbox_backend: SandboxBackend) -> None:
        assert isinstance(sandbox_backend, SandboxBackend)
        assert isinstance(sandbox_backend.name, str) and sandbox_backend.name
        assert sandbox_backend.capabilities().isolation in ISOLATION_ORDER

    def test_create_gives_a_live_sandbox(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> None:
            assert isinstance(sb, Sandbox)
            assert isinstance(sb.id, str) and sb.id
            assert sb.isolation in ISOLATION_ORDER
            assert await sb.alive()

        run(self._with_sandbox(sandbox_backend, body))

    def test_close_is_idempotent_and_final(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body() -> None:
            sb = await sandbox_backend.create(self.base_spec(sandbox_backend))
            assert (await sb.exec("true")).ok
            await sb.close()
            await sb.close()
            assert not await sb.alive()
            with pytest.raises(SandboxError):
                await sb.exec("echo after-close")
            with pytest.raises(SandboxError):
                await sb.read_file(self.base_spec(sandbox_backend).workdir + "/x")

        run(body())

    def test_context_manager_closes(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body() -> None:
            async with await sandbox_backend.create(self.base_spec(sandbox_backend)) as sb:
                assert await sb.alive()
            assert not await sb.alive()

        run(body())

    # ------------------------------------------------------------------ exec
    def test_exec_success(self, sandbox_backend: SandboxBackend, run) -> None:
        res = run(self._with_sandbox(sandbox_backend, lambda sb: sb.exec("echo hello")))
        assert isinstance(res, ExecResult)
        assert (res.exit_code, res.stdout, res.stderr) == (0, "hello\n", "")
        assert res.ok and not res.timed_out and not res.truncated
        assert res.duration_s >= 0

    def test_exec_nonzero_exit_does_not_raise(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> tuple[ExecResult, ExecResult]:
            return await sb.exec("echo partial; exit 7"), await sb.exec("miles-no-such-command-xyz")

        failed, missing = run(self._with_sandbox(sandbox_backend, body))
        assert (failed.exit_code, failed.stdout, failed.ok) == (7, "partial\n", False)
        assert missing.exit_code == 127 and not missing.timed_out

    def test_exec_argv_is_not_shell_split(self, sandbox_backend: SandboxBackend, run) -> None:
        res = run(self._with_sandbox(sandbox_backend, lambda sb: sb.exec(["printf", "%s|", "a b", "$HOME", "c;d"])))
        assert (res.exit_code, res.stdout) == (0, "a b|$HOME|c;d|")

    def test_exec_empty_argv_is_refused(self, sandbox_backend: SandboxBackend, run) -> None:
        with pytest.raises((SandboxError, ValueError)):
            run(self._with_sandbox(sandbox_backend, lambda sb: sb.exec([])))

    def test_streams_are_separate(self, sandbox_backend: SandboxBackend, run) -> None:
        res = run(self._with_sandbox(sandbox_backend, lambda sb: sb.exec("echo out; echo err >&2; echo out2")))
        assert (res.stdout, res.stderr) == ("out\nout2\n", "err\n")

    def test_timeout_reports_and_sandbox_survives(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> tuple[ExecResult, float, ExecResult]:
            t0 = time.monotonic()
            res = await sb.exec("echo started; sleep 30", timeout_s=1.0)
            return res, time.monotonic() - t0, await sb.exec("echo still-usable")

        res, took, after = run(self._with_sandbox(sandbox_backend, body))
        assert res.timed_out and res.exit_code is None and not res.ok
        assert res.stdout == "started\n"
        assert took < 15, f"a 1 s timeout took {took:.1f}s to return"
        assert after.ok and after.stdout == "still-usable\n"

    def test_timeout_kills_the_process_tree(self, sandbox_backend: SandboxBackend, run) -> None:
        if not self.exercise_process_tree_kill:
            pytest.skip("backend opted out of the process-tree kill check")

        async def body(sb: Sandbox) -> tuple[ExecResult, ExecResult]:
            res = await sb.exec("sleep 300 & echo $! > child.pid; sleep 300", timeout_s=1.0)
            probe = await sb.exec("for i in $(seq 50); do kill -0 $(cat child.pid) 2>/dev/null || exit 0; sleep 0.1; done; exit 1")
            return res, probe

        res, probe = run(self._with_sandbox(sandbox_backend, body))
        assert res.timed_out
        assert probe.exit_code == 0, "the background child of a timed-out command is still alive"

    def test_commands_start_with_default_signal_dispositions(self, sandbox_backend: SandboxBackend, run) -> None:
        """A backend's helpers may ignore signals for themselves; an ignored disposition
        survives exec, so a command would inherit it (SIGPIPE: `yes | head` fails; SIGTERM:
        a timeout's polite stop does nothing)."""
        async def body(sb: Sandbox) -> list[ExecResult]:
            return [await sb.exec(f"kill -{sig} $$; echo survived {sig}") for sig in ("PIPE", "TERM", "HUP", "INT")]

        for res in run(self._with_sandbox(sandbox_backend, body)):
            assert "survived" not in res.stdout and res.exit_code != 0, f"signal ignored by the command: {res}"

    def test_output_cap_sets_truncated(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> ExecResult:
            return await sb.exec("head -c 200000 /dev/zero | tr '\\0' x; echo tail >&2; echo done > done.txt", max_output_bytes=1000)

        res = run(self._with_sandbox(sandbox_backend, body))
        assert res.truncated and res.exit_code == 0 and not res.timed_out
        assert res.stdout == "x" * 1000
        assert res.stderr == "tail\n"

    def test_cwd_and_default_workdir(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> tuple[ExecResult, ExecResult]:
            wd = self.base_spec(sandbox_backend).workdir
            await sb.write_file(f"{wd}/sub/marker.txt", b"in-sub")
            return await sb.exec("cat marker.txt", cwd=f"{wd}/sub"), await sb.exec("cat sub/marker.txt")

        in_sub, default = run(self._with_sandbox(sandbox_backend, body))
        assert (in_sub.exit_code, in_sub.stdout) == (0, "in-sub")
        assert (default.exit_code, default.stdout) == (0, "in-sub")

    def test_env_from_spec_and_exec(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> tuple[ExecResult, ExecResult]:
            cmd = 'printf "%s,%s,%s" "$MILES_C_SPEC" "$MILES_C_EXEC" "$MILES_C_BOTH"'
            return await sb.exec(cmd, env={"MILES_C_EXEC": "e x", "MILES_C_BOTH": "exec"}), await sb.exec(cmd)

        with_env, without = run(
            self._with_sandbox(sandbox_backend, body, env={"MILES_C_SPEC": "s'1", "MILES_C_BOTH": "spec"})
        )
        assert with_env.stdout == "s'1,e x,exec"
        assert without.stdout == "s'1,,spec"

    def test_stdin(self, sandbox_backend: SandboxBackend, run) -> None:
        if not self.exercise_stdin:
            pytest.skip("backend opted out of stdin")
        res = run(self._with_sandbox(sandbox_backend, lambda sb: sb.exec("wc -c; echo", stdin=BINARY)))
        assert res.exit_code == 0 and res.stdout.split()[0] == str(len(BINARY))

    # ------------------------------------------------------------------ files
    def test_file_round_trip_is_binary_safe(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> tuple[bytes, bytes, ExecResult, ExecResult, bytes]:
            wd = self.base_spec(sandbox_backend).workdir
            await sb.write_file(f"{wd}/deep/dir/blob.bin", BINARY)
            await sb.write_file(f"{wd}/run.sh", "#!/bin/sh\necho ran-ünicode\n", mode=0o755)
            return (
                await sb.read_file(f"{wd}/deep/dir/blob.bin"),
                await sb.read_file(f"{wd}/deep/dir/blob.bin", max_bytes=10),
                await sb.exec("wc -c < deep/dir/blob.bin"),
                await sb.exec("./run.sh"),
                await sb.read_file(f"{wd}/run.sh"),
            )

        blob, head, size, ran, script = run(self._with_sandbox(sandbox_backend, body))
        assert blob == BINARY and head == BINARY[:10]
        assert size.stdout.strip() == str(len(BINARY))
        assert (ran.exit_code, ran.stdout) == (0, "ran-ünicode\n")
        assert script == "#!/bin/sh\necho ran-ünicode\n".encode()

    def test_read_missing_file_raises_file_not_found(self, sandbox_backend: SandboxBackend, run) -> None:
        async def body(sb: Sandbox) -> bytes:
            return await sb.read_file(self.base_spec(sandbox_backend).workdir + "/no-such-file")

        with pytest.raises(FileNotFoundError):
            run(self._with_sandbox(sandbox_backend, body))

    def test_spec_files_exist_at_start(self, sandbox_backend: SandboxBackend, run) -> None:
        wd = self.base_spec(sandbox_backend).workdir
        files = {f"{wd}/seed/a.txt": b"alpha\n", f"{wd}/seed/b/blob.bin": BINARY}

        async def body(sb: Sandbox) -> tuple[ExecResult, bytes]:
            return await sb.exec("cat seed/a.txt"), await sb.read_file(f"{wd}/seed/b/blob.bin")

        a, blob = run(self._with_sandbox(sandbox_backend, body, files=files))
        assert (a.exit_code, a.stdout) == (0, "alpha\n")
        assert blob == BINARY

    def test_directory_upload_download(self, sandbox_backend: SandboxBackend, run, tmp_path: Path) -> None:
        if not self.exercise_dirs:
            pytest.skip("backend opted out of directory transfers")
        src = tmp_path / "src"
        (src / "a" / "b").mkdir(parents=True)
        (src / "a" / "b" / "blob.bin").write_bytes(BINARY)
        (src / "top.txt").write_text("top\n")
        (src / "empty").write_bytes(b"")
        dst = tmp_path / "dst"

        async def body(sb: Sandbox) -> ExecResult:
            wd = self.base_spec(sandbox_backend).workdir
            await sb.upload_dir(src, f"{wd}/up")
            res = await sb.exec("cat up/top.txt && wc -c < up/a/b/blob.bin && echo new > up/made.txt")
            await sb.download_dir(f"{wd}/up", dst)
            return res

        res = run(self._with_sandbox(sandbox_backend, body))
        assert res.exit_code == 0 and res.stdout.split() == ["top", str(len(BINARY))]
        assert (dst / "a" / "b" / "blob.bin").read_bytes() == BINARY
        assert (dst / "top.txt").read_text() == "top\n" and (dst / "empty").read_bytes() == b""
        assert (dst / "made.txt").read_text() == "new\n"

    # ------------------------------------------------------------------ capabilities
    def test_capabilities_are_truthful(self, sandbox_backend: SandboxBackend, run) -> None:
        """Every spec that asks for more than the capabilities claim is refused at create."""
        caps = sandbox_backend.capabilities()
        asks: list[dict[str, Any]] = []
        for mode in ("none", "public", "allowlist"):
            if mode not in caps.network_modes:
                asks.append({"network": NetworkPolicy(mode=mode, allowed_hosts=("example.com",))})
        if not caps.images:
            asks.append({"image": "python:3.12-slim"})
        if not caps.gpus:
            asks.append({"resources": Resources(gpus=1)})
        if caps.isolation != ISOLATION_ORDER[-1]:
            asks.append({"min_isolation": ISOLATION_ORDER[ISOLATION_ORDER.index(caps.isolation) + 1]})
        if not caps.run_as_user:
            asks.append({"user": "nobody"})
        if caps.max_cpus:
            asks.append({"resources": Resources(cpus=caps.max_cpus * 2)})

        async def body() -> None:
            for ask in asks:
                with pytest.raises(SandboxUnsupportedError):
                    sb = await sandbox_backend.create(self.base_spec(sandbox_backend, **ask))
                    await sb.close()
            for mode in sorted(caps.network_modes - {"allowlist"}):  # each claimed mode really starts
                async with await sandbox_backend.create(
                    self.base_spec(sandbox_backend, network=NetworkPolicy(mode=mode))
                ) as sb:
                    assert (await sb.exec("true")).ok

        run(body())

    def test_network_none_blocks_connections(self, sandbox_backend: SandboxBackend, run) -> None:
        if not self.exercise_network or "none" not in sandbox_backend.capabilities().network_modes:
            pytest.skip("backend does not claim network 'none'")

        async def body() -> tuple[ExecResult, int]:
            accepted = 0

            def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                nonlocal accepted
                accepted += 1
                writer.close()

            server = await asyncio.start_server(on_conn, "0.0.0.0", 0)
            port = server.sockets[0].getsockname()[1]
            hosts = ["127.0.0.1"] + [ip for ip in _host_ips() if not ip.startswith("127.")]
            script = " ".join(
                f"(exec 3<>/dev/tcp/{h}/{port}) 2>/dev/null && echo reached-{h};" for h in hosts
            ) + " exit 0"
            try:
                async with await sandbox_backend.create(self.base_spec(sandbox_backend)) as sb:
                    res = await sb.exec(script, timeout_s=20)
            finally:
                server.close()
            return res, accepted

        res, accepted = run(body())
        assert "reached" not in res.stdout and accepted == 0, (
            f"network 'none' leaked: {accepted} connection(s) accepted; stdout={res.stdout!r} "
            f"stderr={res.stderr[-300:]!r} exit={res.exit_code} timed_out={res.timed_out}"
        )

    def test_labels_are_carried(self, sandbox_backend: SandboxBackend, run) -> None:
        run_id = "contract-" + secrets.token_hex(4)
        labels = {"miles.task": "contract-task", "team": "qa", RUN_LABEL: run_id}

        async def body(sb: Sandbox) -> dict[str, str] | None:
            return await self.labels_of(sandbox_backend, sb)

        seen = run(self._with_sandbox(sandbox_backend, body, labels=labels))
        if seen is None:
            pytest.skip("labels_of() not provided for this backend")
        assert {k: seen.get(k) for k in labels} == labels

    # ------------------------------------------------------------------ sweep
    def test_sweep_removes_only_that_run(self, sandbox_backend: SandboxBackend, run) -> None:
        if not self.exercise_sweep or not isinstance(sandbox_backend, SweepableBackend):
            pytest.skip("backend creates no remote resources (no sweep)")
        mine, other = "contract-" + secrets.token_hex(4), "contract-" + secrets.token_hex(4)

        async def body() -> tuple[list[str], list[str], Sandbox, Sandbox]:
            leaked = await sandbox_backend.create(self.base_spec(sandbox_backend, labels={RUN_LABEL: mine}))
            kept = await sandbox_backend.create(self.base_spec(sandbox_backend, labels={RUN_LABEL: other}))
            try:
                first = await sandbox_backend.sweep(mine)
                second = await sandbox_backend.sweep(mine)
                assert await kept.alive()
                with pytest.raises(SandboxError):
                    await leaked.exec("true")
            finally:
                await kept.close()
                await leaked.close()
                await sandbox_backend.sweep(other)
            return first, second, leaked, kept

        first, second, leaked, _ = run(body())
        assert first == [leaked.id]
        assert second == []


def _host_ips() -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    except OSError:
        return []
