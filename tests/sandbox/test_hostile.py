"""The hostile suite against both local tiers: what is contained, and honest about what is not."""

from __future__ import annotations

import pytest

from miles_engine.sandbox.hostile import CASE_NAMES, run_hostile_suite

from .conftest import IS_ROOT, needs_ns, run

pytestmark = pytest.mark.timeout(120)

# What the process tier cannot contain: it shares the host's network and filesystem.
PROCESS_TIER_ESCAPES = {"network_tcp", "network_dns", "write_outside", "read_host_files"}


@needs_ns
def test_namespace_tier_contains_every_case(ns_backend):
    results = run(run_hostile_suite(ns_backend, concurrency=6), timeout=90)
    assert [r.case for r in results] == list(CASE_NAMES)
    failed = {r.case: r.detail for r in results if not r.contained}
    assert failed == {}
    assert all(r.leftover_processes == 0 for r in results)


def test_process_tier_reports_what_it_cannot_contain(proc_backend):
    results = {r.case: r for r in run(run_hostile_suite(proc_backend, concurrency=6), timeout=90)}
    escaped = {name for name, r in results.items() if not r.contained}
    expected = set(PROCESS_TIER_ESCAPES)
    if not IS_ROOT:
        # Without a dedicated uid: no per-sandbox process limit (the fork bomb is not even
        # run), and a daemon that both detaches and scrubs its environment cannot be tracked.
        expected |= {"fork_bomb", "daemon_left_behind"}
    assert escaped == expected, {n: results[n].detail for n in escaped ^ expected}
    assert "host listener accepted" in results["network_tcp"].detail
    assert all(r.leftover_processes == 0 for r in results.values() if r.contained)


def test_unknown_case_is_an_error(ns_backend):
    with pytest.raises(ValueError, match="unknown hostile case"):
        run(run_hostile_suite(ns_backend, cases=["nope"]))
