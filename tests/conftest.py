"""Shared fixtures: throwaway plugin distributions installed onto sys.path for one test."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest


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
