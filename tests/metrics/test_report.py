"""`miles report`: PNGs and a self-contained HTML page from a run directory."""

from __future__ import annotations

import base64
import json

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli, main
from miles_engine.metrics import keys as K
from miles_engine.report import ReportError, RunData, edge_means, moving_average, render_report
from tests.metrics.synthetic import STEPS, reward_at, write_run

pytest.importorskip("matplotlib")


def test_moving_average_and_edges():
    assert moving_average([1, 2, 3, 4], [0.0, 0.3, 0.6, 0.9]) == ([3, 4], pytest.approx([0.3, 0.6]))
    assert moving_average([5, 6], [1.0, 0.0]) == ([6], [0.5])
    assert moving_average([], []) == ([], [])
    assert edge_means([float(i) for i in range(10)]) == (0.5, 8.5)
    assert edge_means([1.0, 3.0]) == (1.0, 3.0)


def test_rundata_merges_resumed_steps_and_aliases():
    rows = [{"step": 1, "time": 1, "kind": "train", "reward/mean": 0.0, "staleness/avg": 2.0},
            {"step": 2, "time": 2, "kind": "train", "reward/mean": 0.5},
            {"step": 2, "time": 3, "kind": "train", "reward/mean": 0.7, "reward/mean_extra": None},  # resumed
            {"step": 1, "time": 3.5, "kind": "eval", "eval/reward": 0.9}]
    data = RunData(rows)
    assert data.series(K.REWARD_MEAN) == ([1, 2], [0.0, 0.7])
    assert data.series(K.STALENESS_AVG) == ([1], [2.0])  # alias of buffer/taken/s_old_avg
    assert data.series(K.EVAL_REWARD) == ([], []) and data.series(K.EVAL_REWARD, None) == ([1], [0.9])
    assert data.wall_time == 3.5 and data.summary()["train steps"] == 2


def test_report_renders_pngs_and_self_contained_html(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    result = render_report(run)
    names = sorted(p.name for p in result.pngs)
    assert names == sorted(["reward.png", "tool_use.png", "staleness.png", "queue.png", "tis.png",
                            "step_time.png", "eval.png", "sft_loss.png", "train.png"])
    for png in result.pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.parent == run / "report"
    html = result.html.read_text()
    assert result.html == run / "report" / "report.html"
    assert html.count("src='data:image/png;base64,") == len(result.pngs)
    assert "<img" in html and ".png'" not in html  # nothing loaded from disk
    first = base64.b64decode(html.split("data:image/png;base64,")[1].split("'")[0])
    assert first == (run / "report" / "reward.png").read_bytes()

    rewards = [reward_at(s) for s in range(1, STEPS + 1)]
    s = result.summary
    assert s["train steps"] == STEPS and s["sft steps"] == 5
    assert s["reward, first 20% mean"] == pytest.approx(sum(rewards[:4]) / 4)
    assert s["reward, last 20% mean"] == pytest.approx(sum(rewards[-4:]) / 4)
    assert s["max 3-step moving avg reward"] == pytest.approx(sum(rewards[-3:]) / 3)
    assert s["max 3-step moving avg reward (two_turn)"] == pytest.approx(sum(rewards[-3:]) / 3 - 0.05)
    assert s["eval reward, last"] == pytest.approx(reward_at(20)) and s["samples trained"] == 16 * STEPS
    assert "train steps</td><td class='num'>20<" in html
    assert f"{s['reward, first 20% mean']:.4f}".rstrip("0") in html
    assert "max 3-step moving avg reward</td><td class='num'>0.86<" in html
    assert "lr: 1.0e-4  # &lt;tag&gt;" in html  # config.yaml, escaped


def test_report_draws_only_what_was_logged_and_honours_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "time": float(s), "kind": "train", K.REWARD_MEAN: 0.1 * s, K.QUEUE_SIZE: 2}
            for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = render_report(run, tmp_path / "out")
    assert sorted(p.name for p in result.pngs) == ["queue.png", "reward.png"]
    assert result.html == tmp_path / "out" / "report.html" and "Config" not in result.html.read_text()


def test_cli_report(tmp_path):
    run = tmp_path / "run"
    write_run(run, steps=6, sft_steps=0)
    result = CliRunner().invoke(cli, ["report", str(run), "--out", str(tmp_path / "r")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "report.html" in result.stdout and "max 3-step moving avg reward" in result.stdout
    assert (tmp_path / "r" / "reward.png").is_file() and not (tmp_path / "r" / "sft_loss.png").exists()


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "has no metrics.jsonl"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("")), "has no metric rows"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"step": 1, "ti')), "has no metric rows"),
])
def test_cli_report_bad_run_dir_is_one_clear_error(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(ReportError, match=message):
        render_report(run)
    with pytest.raises(SystemExit) as exc:
        main(["report", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (run / "report").exists()


def test_missing_matplotlib_names_the_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ReportError, match="pip install matplotlib"):
        render_report(tmp_path)


def test_report_names_the_trajectory_record_and_how_to_open_it(tmp_path):
    from miles_engine.metrics.trajectory_store import TrajectoryWriter

    run = tmp_path / "run"
    write_run(run, steps=6, sft_steps=0)
    assert "trajectories" not in render_report(run).html.read_text()  # a run without a record: no line
    writer = TrajectoryWriter(run)
    assert "trajectories" not in render_report(run).html.read_text()  # nor with an empty one
    writer.append([({"step": 1, "group_id": "g", "index": 0}, {})])
    writer.close()
    result = render_report(run)
    assert result.trajectories == run / "trajectories.mtr"
    assert f"`miles dashboard {run}` opens it" in result.html.read_text()
    out = CliRunner().invoke(cli, ["report", str(run)], catch_exceptions=False)
    assert out.exit_code == 0 and f"trajectories: {run / 'trajectories.mtr'}" in out.stdout.replace("\n", "")
    assert f"miles dashboard {run}" in out.stdout.replace("\n", "")
