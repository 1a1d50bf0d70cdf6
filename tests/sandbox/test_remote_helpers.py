"""The shared remote-adapter helpers: retries only what they are given, one clear error at
the end, credentials named never shown, output capped and decoded."""

from __future__ import annotations

import asyncio

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import RUN_LABEL, SANDBOX_LABEL, SandboxSpec
from miles_engine.sandbox.remote import (
    QuotaError,
    RetryPolicy,
    TransientError,
    cap_output,
    normalise_streams,
    process_run_id,
    read_capped,
    redact,
    require_env,
    retry_idempotent,
    run_id_for,
    sandbox_labels,
)

pytestmark = pytest.mark.timeout(30)


class Flaky:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def _retry(call, policy: RetryPolicy, delays: list[float]):
    async def sleep(d: float) -> None:
        delays.append(d)

    return asyncio.run(retry_idempotent(call, what="create sandbox", policy=policy, sleep=sleep))


def test_transient_failures_are_retried_with_growing_backoff():
    call, delays = Flaky([TransientError("conn reset"), TransientError("502")]), []
    assert _retry(call, RetryPolicy(attempts=3, base_delay_s=1.0), delays) == "ok"
    assert call.calls == 3
    assert 0.75 <= delays[0] <= 1.25 and 1.5 <= delays[1] <= 2.5


def test_transient_failures_exhaust_into_one_error():
    call, delays = Flaky([TransientError("conn reset")] * 5), []
    with pytest.raises(SandboxError, match=r"create sandbox failed after 2 tries: conn reset"):
        _retry(call, RetryPolicy(attempts=2, base_delay_s=0.01), delays)
    assert call.calls == 2


def test_quota_gets_its_own_budget_then_a_clear_error():
    call, delays = Flaky([QuotaError("429 Too Many Requests")] * 10), []
    with pytest.raises(SandboxError, match=r"still throttling / over quota after 4 tries.*429"):
        _retry(call, RetryPolicy(attempts=1, quota_attempts=4, base_delay_s=1.0, max_delay_s=2.0), delays)
    assert call.calls == 4 and len(delays) == 3 and max(delays) <= 2.5


def test_other_errors_are_not_retried():
    call = Flaky([PermissionError("401 unauthorized")])
    with pytest.raises(PermissionError):
        _retry(call, RetryPolicy(), [])
    assert call.calls == 1


def test_require_env_names_the_variable_and_never_the_value(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    monkeypatch.delenv("E2B_ACCESS_TOKEN", raising=False)
    with pytest.raises(SandboxError) as exc:
        require_env("e2b", "E2B_API_KEY", "E2B_ACCESS_TOKEN")
    msg = str(exc.value)
    assert "\n" not in msg and "E2B_API_KEY" in msg and "E2B_ACCESS_TOKEN" in msg
    monkeypatch.setenv("E2B_ACCESS_TOKEN", "  tok-secret-123 ")
    assert require_env("e2b", "E2B_API_KEY", "E2B_ACCESS_TOKEN") == "tok-secret-123"
    assert redact("bad key tok-secret-123 given", ["tok-secret-123", None]) == "bad key *** given"


def test_output_is_capped_by_bytes_and_decoded_safely():
    assert cap_output("héllo", 2) == (b"h\xc3", True)
    assert cap_output(None, 5) == (b"", False)
    out, err, truncated = normalise_streams("héllo", b"\xff ok", 2)
    assert (out, err, truncated) == ("h\ufffd", "\ufffd ", True)
    assert normalise_streams(b"a", "b", 10) == ("a", "b", False)


def test_read_capped_drains_past_the_cap():
    async def go() -> tuple[bytes, bool]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"x" * 100_000)
        reader.feed_eof()
        got = await read_capped(reader, 10, chunk=4096)
        assert reader.at_eof()
        return got

    assert asyncio.run(go()) == (b"x" * 10, True)


def test_run_labels(monkeypatch):
    monkeypatch.delenv("MILES_RUN_ID", raising=False)
    generated = process_run_id()
    assert generated.startswith("run-") and process_run_id() == generated
    monkeypatch.setenv("MILES_RUN_ID", "nightly-7")
    assert run_id_for(SandboxSpec(), None) == "nightly-7"
    assert run_id_for(SandboxSpec(), "cfg-run") == "cfg-run"
    assert run_id_for(SandboxSpec(labels={RUN_LABEL: "spec-run"}), "cfg-run") == "spec-run"
    labels = sandbox_labels(SandboxSpec(labels={"team": "qa"}), sandbox_id="sb-1", run_id="r")
    assert labels == {"team": "qa", RUN_LABEL: "r", SANDBOX_LABEL: "sb-1"}
