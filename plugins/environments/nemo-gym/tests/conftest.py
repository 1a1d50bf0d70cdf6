"""Fixtures: a NeMo-Gym-format resources server (uvicorn subprocess on 127.0.0.1) and dataset rows.
Also makes the local test kit importable (``from nemo_gym_testkit import ...``) under any import mode."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from miles_env_nemo_gym import ServerCommandOptions, ServerProcess  # noqa: E402
from nemo_gym_testkit import free_port, make_row, server_command, write_rows  # noqa: E402


@pytest.fixture(scope="session")
def resources_url() -> Iterator[str]:
    port = free_port()
    opts = ServerCommandOptions(command=server_command(port), url=f"http://127.0.0.1:{port}", startup_timeout_s=60)
    server = ServerProcess(opts, env_name="test-resources-server")
    server.ensure_started()
    yield opts.url
    server.close()


@pytest.fixture
def rows_file(tmp_path: Path) -> Path:
    return write_rows(tmp_path / "rows.jsonl", [make_row(i, secret=3 + i) for i in range(4)])
