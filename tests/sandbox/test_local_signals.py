"""Commands get default signal dispositions even when the driver itself was started with
signals ignored (a background job of a script ignores SIGINT/SIGQUIT, nohup ignores SIGHUP)."""

from __future__ import annotations

import signal

import pytest

from miles_engine.sandbox.local import signals
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec

from .conftest import HAS_NS, run

VARIANTS = {
    "process": ({"isolation": "process"}, SandboxSpec(paths=(), network=NetworkPolicy(mode="public"))),
    "namespace": ({"isolation": "namespace"}, SandboxSpec()),
    "namespace-nsenter": ({"isolation": "namespace", "exec_via_init": False}, SandboxSpec()),
    "namespace-warm": ({"isolation": "namespace", "warm_pool_size": 2}, SandboxSpec()),
}
PROBES = [f"kill -{name} $$; echo survived {name}" for name in ("INT", "HUP", "TERM")]  # bash ignores QUIT
MASK = "grep SigIgn /proc/self/status"  # what an exec'd program starts with


@pytest.fixture
def parent_ignores_signals():
    names = ("SIGINT", "SIGQUIT", "SIGHUP")
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names}
    for n in names:
        signal.signal(getattr(signal, n), signal.SIG_IGN)
    try:
        yield
    finally:
        for n, handler in saved.items():
            signal.signal(getattr(signal, n), handler)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("env_reset", [True, False], ids=["env", "preexec"])
def test_commands_do_not_inherit_the_drivers_ignored_signals(variant, env_reset, parent_ignores_signals,
                                                             monkeypatch):
    options, spec = VARIANTS[variant]
    if variant != "process" and not HAS_NS:
        pytest.skip("no user namespaces here")
    assert signals.ignored() == ["INT", "QUIT", "HUP"]
    if not env_reset:  # an env without --default-signal: the reset happens in a preexec_fn
        monkeypatch.setattr(signals, "_env_ok", False)

    async def go():
        be = LocalSandboxBackend(LocalSandboxOptions(**options))
        try:
            out = []
            for _ in range(2):  # the second sandbox of a warm pool is a reused one
                async with await be.create(spec) as sb:
                    out += [await sb.exec(p) for p in PROBES]
                    out.append(await sb.exec(MASK))
            return out
        finally:
            await be.aclose()

    results = run(go(), 90)
    for res in results:
        if res.stdout.startswith("SigIgn"):
            assert res.stdout == "SigIgn:\t0000000000000000\n", res
        else:
            assert "survived" not in res.stdout and res.exit_code != 0, res
