"""Shared helpers: assistant transcripts and a real pytest run's outputs (recorded once per session)."""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from miles_engine.environments.protocol import EpisodeContext
from miles_engine.testing.reward import SampleTask


def said(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "solve it"}] + [{"role": "assistant", "content": t} for t in texts]


def episode(*texts: str, metadata: dict | None = None, sandbox=None) -> EpisodeContext:
    return EpisodeContext(task=SampleTask("t", dict(metadata or {}), sandbox=sandbox is not None),
                          sandbox=sandbox, transcript=said(*texts))


@functools.cache
def real_pytest_run() -> tuple[bytes, str]:
    """JUnit XML and console output of a real pytest run: 2 passed, 1 failed, 1 error, 1 skipped."""
    with tempfile.TemporaryDirectory(prefix="miles-pytest-fixture-") as tmp:
        test = Path(tmp) / "test_sample.py"
        test.write_text(textwrap.dedent("""
            import pytest

            @pytest.fixture
            def broken():
                raise RuntimeError("fixture breaks")

            def test_a(): assert 1
            def test_b(): assert 2
            def test_c(): assert 0
            def test_d(broken): pass
            @pytest.mark.skip(reason="not today")
            def test_e(): pass
        """))
        junit = Path(tmp) / "junit.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
                              f"--junitxml={junit}", str(test)], capture_output=True, text=True, timeout=120,
                             cwd=tmp)
        return junit.read_bytes(), run.stdout
