"""Shared fixtures: throwaway plugin distributions installed onto sys.path for one test; the warm
tiny-terminal run the end-to-end tests resume and the recipe's learning run (each built once per
session, only when asked for, and shared by pytest-xdist's workers)."""

from __future__ import annotations

import fcntl
import importlib
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.run.fleet_helpers import make_recipe_run, make_warm_run


class FakeDistributions:
    """Writes real ``*.dist-info`` directories so ``importlib.metadata`` finds entry points."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[miles]\n{eps}\n")


@pytest.fixture
def fake_dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDistributions]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    before = set(sys.modules)
    yield FakeDistributions(root)
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(root) in (sys.modules[name].__file__ or ""):
            del sys.modules[name]


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MILES_DISABLE_PLUGIN_AUTOLOAD", "MILES_PLUGINS", "MILES_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """``build(empty_dir)``'s result, built by the first of the session's processes to ask (pytest-xdist
    runs several: they share the session's base temp directory) while the others wait, then reused."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/popen-gwK -> pytest-N, one per session
    done = root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            done.write_text(str(build(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root)))))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def warm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # MILES_TEST_WARM_RUN: a run directory made earlier by make_warm_run (same recipe, same code), so
    # repeated runs of the slow e2e tests on a developer box skip the SFT warm start; tests copy it
    prebuilt = os.environ.get("MILES_TEST_WARM_RUN")
    if prebuilt:
        path = Path(prebuilt)
        assert (path / "checkpoints").is_dir(), f"MILES_TEST_WARM_RUN={prebuilt}: not a run directory with checkpoints"
        return path
    return built_once(tmp_path_factory, "warm", make_warm_run)


@pytest.fixture(scope="session")
def recipe_run(warm_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm run resumed for 30 RL steps as shipped (``make_recipe_run``): read it, never write."""
    return built_once(tmp_path_factory, "recipe", lambda out: make_recipe_run(warm_run, out / "run"))
