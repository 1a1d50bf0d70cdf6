"""The warm tiny-terminal run the fleet and Ray end-to-end tests resume (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.fleet_helpers import make_warm_run


@pytest.fixture(scope="session")
def warm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_warm_run(tmp_path_factory.mktemp("fleet"))
