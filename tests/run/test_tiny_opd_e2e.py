"""The packaged tiny-opd recipe, shortened: a start-up teacher distils into the student with the
reverse-KL term as the only signal, and the per-token reverse KL must fall (margin, not exact)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli

SHORT = [
    "opd.train_teacher.demos=1500", "opd.train_teacher.epochs=1",
    "sft.demos=320",
    "rollout.groups_per_step=4", "rollout.max_inflight=16",
    "run.steps=10", "run.max_minutes=null",
    "metrics.progress=false",
]


def _train(tmp_path: Path, *extra: str):
    return CliRunner().invoke(cli, ["train", "tiny-opd", *SHORT, f"run.out_dir={tmp_path}", "run.name=opd", *extra],
                              catch_exceptions=False)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_tiny_opd_reverse_kl_falls(tmp_path: Path) -> None:
    result = _train(tmp_path)
    assert result.exit_code == 0, result.output
    run = tmp_path / "opd"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    teacher = [r for r in rows if r["kind"] == "teacher"]
    train = [r for r in rows if r["kind"] == "train"]
    assert teacher[-1]["teacher_sft/loss"] < 0.5 * teacher[0]["teacher_sft/loss"]
    assert (run / "teacher" / "config.json").is_file() and (run / "teacher" / "tokenizer.json").is_file()
    kl = [r["opd/reverse_kl"] for r in train]
    assert len(kl) >= 6, kl
    first, last = statistics.fmean(kl[:3]), statistics.fmean(kl[-3:])
    assert last < 0.8 * first, f"per-token reverse KL did not fall by 20%: {kl}"
    assert all(r["rollout/failed"] == 0 for r in train)


@pytest.mark.timeout(240)
def test_sample_without_route_fails_before_training(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["train", "tiny-opd", *SHORT, f"run.out_dir={tmp_path}", "run.name=bad",
                                 "opd.default=null", "opd.route_tag=kind", "opd.routes={echo: drills}"])
    assert result.exit_code != 0
    assert "matches no route in opd.routes (echo) and opd.default is unset" in result.output + str(result.exception)
    assert not (tmp_path / "bad" / "teacher").exists()  # refused before the teacher was trained
