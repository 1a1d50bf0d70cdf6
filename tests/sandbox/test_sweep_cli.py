"""``miles sandbox sweep``: calls the backend's sweep; a backend without one is one clear error."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from miles_engine.cli import sandbox_cmd
from miles_engine.cli.main import cli, main
from miles_engine.sandbox.protocol import Capabilities, SweepableBackend

pytestmark = pytest.mark.timeout(60)


class RecordingSweeper:
    """A remote backend stand-in holding labelled sandboxes in a dict."""

    name = "recording"

    def __init__(self) -> None:
        self.sandboxes = {"sb-1": "run-a", "sb-2": "run-b", "sb-3": "run-a"}
        self.closed = False

    def capabilities(self) -> Capabilities:
        return Capabilities(isolation="container")

    async def create(self, spec):  # pragma: no cover - not used by sweep
        raise NotImplementedError

    async def sweep(self, run_id: str) -> list[str]:
        gone = sorted(i for i, run in self.sandboxes.items() if run == run_id)
        for i in gone:
            del self.sandboxes[i]
        return gone

    async def aclose(self) -> None:
        self.closed = True


def test_recording_sweeper_is_a_sweepable_backend():
    assert isinstance(RecordingSweeper(), SweepableBackend)


def test_sweep_removes_the_runs_sandboxes_and_is_idempotent(monkeypatch):
    backend = RecordingSweeper()
    monkeypatch.setattr(sandbox_cmd, "build_sandbox_backend", lambda hub, name, options: backend)
    runner = CliRunner()
    first = runner.invoke(cli, ["sandbox", "sweep", "--backend", "recording", "--run", "run-a", "--json"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout) == ["sb-1", "sb-3"]
    assert backend.sandboxes == {"sb-2": "run-b"} and backend.closed
    again = runner.invoke(cli, ["sandbox", "sweep", "--backend", "recording", "--run", "run-a"])
    assert again.exit_code == 0 and "removed 0 sandbox(es) labelled miles.run=run-a" in again.stdout


def test_sweep_on_a_backend_without_sweep_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sandbox", "sweep", "--backend", "local", "-o", "isolation=process", "--run", "r1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "sandbox backend 'local' has no sweep" in err


def test_sweep_needs_a_run_id():
    res = CliRunner().invoke(cli, ["sandbox", "sweep", "--backend", "local"])
    assert res.exit_code == 2 and "--run" in res.output
