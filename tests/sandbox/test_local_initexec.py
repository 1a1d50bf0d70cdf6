"""PID 1 as the exec server (bubblewrap tier): what sandboxed code can do to it, and the
nsenter path kept beside it."""

from __future__ import annotations

import pytest

from miles_engine.sandbox.hostile import CASE_NAMES, run_hostile_suite
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.protocol import SandboxSpec
from miles_engine.testing import SandboxContract

from .conftest import HAS_NS, PROBE, run

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not HAS_NS or PROBE.tools is None or PROBE.tools.launcher != "bwrap",
                       reason=f"PID 1 runs commands in the bubblewrap tier only: {PROBE.detail}"),
]


def backend(**kw) -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxOptions(isolation="namespace", kill_grace_s=0.3, **kw))


def test_commands_that_kill_everything_they_can_still_report():
    async def go():
        b = backend()
        try:
            async with await b.create(SandboxSpec()) as sb:
                assert sb._channel is not None
                killer = await sb.exec("sleep 30 & kill -9 -1; echo done; exit 3")
                after = await sb.exec("echo ok")
                return killer, after
        finally:
            await b.aclose()

    killer, after = run(go())
    assert (killer.stdout, killer.exit_code) == ("done\n", 3)
    assert after.stdout == "ok\n"


def test_a_forged_request_to_pid_1_gets_no_more_than_the_sandbox_limits():
    """Sandboxed code writing a request into PID 1's stdin (through /proc) gets a command
    with PID 1's hard limits: the sandbox's, not the host's."""
    forge = r"""
    f=/proc/1/fd/0
    if ! exec 7>"$f" 2>/dev/null; then echo "cannot open"; exit 0; fi
    printf 'run\0abcd\0/\0/dev/null\0/tmp/forged\0/dev/null\0\0000\0003\0bash\0-c\0ulimit -Hu; ulimit -Hv; ulimit -Hn\0' >&7
    for _ in $(seq 50); do [ -s /tmp/forged ] && break; sleep 0.05; done
    cat /tmp/forged
    """

    async def go():
        b = backend(max_processes=77, memory_mb=512, max_open_files=99)
        try:
            async with await b.create(SandboxSpec()) as sb:
                r = await sb.exec(forge)
                ok = await sb.exec("echo still working")
                return r, ok
        finally:
            await b.aclose()

    r, ok = run(go())
    assert ok.stdout == "still working\n"
    if r.stdout.strip() != "cannot open":
        assert r.stdout.split() == ["77", str(512 * 1024), "99"], r


def test_exec_details_match_the_nsenter_path():
    script = "echo out; echo err >&2; echo $SPEC_VAR $EXEC_VAR; pwd; cat; id -u; exit 7"
    # PID 1 ignores signals for itself; a command must start with the default dispositions
    # (an ignored SIGPIPE survives exec: `yes | head` would print "Broken pipe" and exit 1)
    signals = "grep SigIgn /proc/self/status; yes | head -1; echo ${PIPESTATUS[*]}"
    # through PID 1 each command leads its own process group (what a timeout's kill signals)
    group = 's=$(cat /proc/$$/stat); set -- ${s##*) }; [ "$3" = "$$" ] && echo leader'

    async def one(via_init: bool):
        b = backend(exec_via_init=via_init)
        try:
            spec = SandboxSpec(env={"SPEC_VAR": "s"}, workdir="/app")
            async with await b.create(spec) as sb:
                assert (sb._channel is not None) == via_init
                r = await sb.exec(script, env={"EXEC_VAR": "e"}, stdin=b"in\n")
                missing = await sb.exec(["no-such-program-xyz"])
                bad_cwd = await sb.exec("true", cwd="/no/such/dir")
                slow = await sb.exec("sleep 5", timeout_s=0.3)
                sig = await sb.exec(signals)
                leader = await sb.exec(group)
                tree = await sb.exec("sleep 30 & sleep 31 & wait", timeout_s=0.3)
                left = await sb.exec("ps -eo args= | grep -c '^sleep 3[01]$'")
                return r, missing, bad_cwd, slow, sig, leader, tree, left
        finally:
            await b.aclose()

    new, old = run(one(True)), run(one(False))
    r, r0 = new[0], old[0]
    assert (r.stdout, r.stderr, r.exit_code) == (r0.stdout, r0.stderr, r0.exit_code) == (
        "out\ns e\n/app\nin\n0\n", "err\n", 7)
    assert new[1].exit_code == old[1].exit_code == 127
    assert new[2].exit_code == old[2].exit_code == 125 and "/no/such/dir" in new[2].stderr
    assert new[3].timed_out and old[3].timed_out and new[3].exit_code is None
    assert (new[4].stdout, new[4].stderr) == (old[4].stdout, old[4].stderr) == (
        "SigIgn:\t0000000000000000\ny\n141 0\n", "")
    assert new[5].stdout == "leader\n"  # (through nsenter the group's leader is the host-side launcher)
    assert new[6].timed_out and old[6].timed_out
    assert new[7].stdout == old[7].stdout == "0\n"  # the timed-out command's whole group is gone


def test_hostile_suite_through_nsenter():
    async def go():
        b = backend(exec_via_init=False)
        try:
            return await run_hostile_suite(b, concurrency=6)
        finally:
            await b.aclose()

    results = run(go(), timeout=100)
    assert [r.case for r in results] == list(CASE_NAMES)
    assert {r.case: r.detail for r in results if not r.contained} == {}
    assert all(r.leftover_processes == 0 for r in results)


class TestNsenterExecContract(SandboxContract):
    def make_backend(self) -> LocalSandboxBackend:
        return backend(exec_via_init=False)
