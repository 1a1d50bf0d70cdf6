"""The warm tiny-terminal run the fleet and Ray end-to-end tests resume (built once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.train.fleet_helpers import make_warm_run


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
