"""`miles train --resume RUN_DIR` continues from the newest checkpoint with the same numbering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli

FAST = ["sft.enabled=false", "tokenizer.corpus_demos=500", "rollout.mode=sync", "placement.trainer=in_process",
        "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_inflight=8", "buffer.capacity_groups=4",
        "run.checkpoint_every=1", "metrics.progress=false"]


def train(*args: str) -> None:
    result = CliRunner().invoke(cli, ["train", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.mark.timeout(240)
def test_resume_continues_step_and_weight_version(tmp_path: Path) -> None:
    train("tiny-terminal", *FAST, "run.steps=2", f"run.out_dir={tmp_path}", "run.name=r")
    run = tmp_path / "r"
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000001", "step_00000002"]
    train("--resume", str(run), "run.steps=3")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    versions = [r["weights/version"] for r in rows if r["kind"] == "train"]
    assert steps == [1, 2, 3]
    assert versions == sorted(versions) and len(set(versions)) == 3  # numbering continues, no restart at 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


def test_resume_without_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    from miles_engine.errors import ConfigError

    (tmp_path / "config.yaml").write_text((Path(__file__).parents[2] / "recipes" / "tiny-terminal.yaml").read_text())
    with pytest.raises(ConfigError, match="no checkpoint"):
        CliRunner().invoke(cli, ["train", "--resume", str(tmp_path), *FAST], catch_exceptions=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_finishes_the_step_checkpoints_and_leaves_nothing_running(tmp_path: Path,
                                                                                     signame: str) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "c"
    cmd = [sys.executable, "-m", "miles_engine.cli.main", "train", "tiny-terminal", *FAST, "run.steps=1000",
           "run.checkpoint_every=0", f"run.out_dir={tmp_path}", "run.name=c"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and any(json.loads(line).get("kind") == "train"
                                        for line in metrics.read_text().splitlines() if line.endswith("}")):
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        proc.send_signal(getattr(signal, signame))
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-2000:]
    assert "stopping after the current step" in out and "continue: miles train --resume" in out
    assert any((run / "checkpoints").iterdir())
    survivors = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not survivors, f"processes left in the run's session: {survivors}"
