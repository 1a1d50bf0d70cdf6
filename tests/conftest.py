"""Shared fixtures: throwaway plugin distributions installed onto sys.path for one test; the warm
tiny-terminal run the end-to-end tests resume (built once per session, only when asked for)."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.run.fleet_helpers import make_warm_run


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


@pytest.fixture(scope="session")
def warm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # MILES_TEST_WARM_RUN: a run directory made earlier by make_warm_run (same recipe, same code), so
    # repeated runs of the slow e2e tests on a developer box skip the SFT warm start; tests copy it
    prebuilt = os.environ.get("MILES_TEST_WARM_RUN")
    if prebuilt:
        path = Path(prebuilt)
        assert (path / "checkpoints").is_dir(), f"MILES_TEST_WARM_RUN={prebuilt}: not a run directory with checkpoints"
        return path
    return make_warm_run(tmp_path_factory.mktemp("fleet"))
