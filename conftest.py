"""The whole suite's policy on skips (tests/ and every plugin's tests), and what may run side by side.

Under ``CI=true`` a skipped test is a failure: CI installs everything the plain CPU run needs
(``./dev.sh test``), so a skip there means an install step is missing and a green run would hide
untested code. Exempt: tests marked ``gpu`` or ``cloud``, and the reasons on the short, reviewed
list below, each with why it may skip on a fully provisioned CPU box.

Under pytest-xdist (``./dev.sh test`` runs two workers: much of the suite waits on subprocesses,
servers and containers, and the box has two cores) every test file runs whole on one worker (its
module fixtures are built once), and the files that share a machine-wide resource form one group,
run one after another on one worker (``SHARED``).
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import pytest

# reason text (a substring of the skip reason) -> why that skip is expected on CI's CPU box
ALLOWED_SKIPS: dict[str, str] = {
    # the sandbox contract suite (miles_engine.testing.sandbox) checks every capability a backend may
    # claim; the local backend does not claim these, so its runs of those checks do not apply
    "labels_of() not provided for this backend": "the local backend keeps no labels (remote backends do)",
    "backend creates no remote resources (no sweep)": "the local backend leaves nothing remote to sweep",
    "backend does not claim network 'none'": "the local backend's process tier has no network namespace",
}

EXEMPT_MARKERS = ("gpu", "cloud")


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _allowed(reason: str) -> bool:
    return any(text in reason for text in ALLOWED_SKIPS)


def _fail(report: pytest.CollectReport | pytest.TestReport, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true: {reason}\nCI runs everything the plain CPU run needs: give "
                       f"./dev.sh test the missing install step, mark the test gpu or cloud, or add this reason "
                       f"to ALLOWED_SKIPS in conftest.py with why it may skip")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not (_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    if any(item.get_closest_marker(m) for m in EXEMPT_MARKERS):
        return
    reason = _reason(report)
    if not _allowed(reason):
        _fail(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped:  # a whole module skipped while collected (importorskip, a module-level skip)
        reason = _reason(report)
        if not _allowed(reason):
            _fail(report, reason)


# group -> what puts a test file in it (a regex over its source): the container engine (its sweeps,
# the host's network interfaces its containers add), a Ray cluster (one head per box), vLLM (its
# server pins its engine to core 0)
SHARED: dict[str, re.Pattern[str]] = {
    "container-engine": re.compile(r"docker|podman|sandbox\.backend|/proc/net/dev", re.IGNORECASE),
    "ray": re.compile(r"\bray\b"),
    "vllm": re.compile(r"kind: vllm|VllmKind|vllm\.options import"),
}


@cache
def _source(path: Path) -> str:
    return path.read_text(errors="replace")


@cache
def _group(path: Path) -> str:
    source = _source(path)
    for group, pattern in SHARED.items():
        if pattern.search(source):
            return group
    return str(path)


@cache
def _rank(scope: str) -> int:
    """Order of the work units, so that the long ones start early and the short ones fill the end on
    both workers: the container engine's group (long, and it needs no warm run: it runs while the
    other worker builds the session's warm run), the units that resume the warm run, the other slow
    files, the rest."""
    if scope in SHARED:
        return 0 if scope == "container-engine" else 1
    source = _source(Path(scope))
    if "warm_run" in source or "recipe_run" in source:
        return 1
    return 2 if "mark.slow" in source else 3


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """xdist's load-scope scheduling with our work units (a test file, or a ``SHARED`` group of files)
    in our order (``_rank``). Not ``--dist loadgroup``: its marks reach the scheduler through a nodeid
    rewrite that pytest 9.2 ignores; and xdist's own order (most tests first) leaves the few-test
    learning runs to the end."""
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndSharedResources(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(config.rootpath / nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
            if self.workqueue:  # the next unit handed out: the first of the best rank
                self.workqueue.move_to_end(min(self.workqueue, key=_rank), last=False)
            super()._assign_work_unit(node)

    return FilesAndSharedResources(config, log)
