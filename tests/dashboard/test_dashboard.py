"""`miles dashboard` without a browser: CLI errors, the incremental readers, the pages over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.dashboard.data import MetricsTail, NotARunError, RunView, check_run_dir
from miles_engine.dashboard.views import token_page
from miles_engine.metrics.trajectory_store import TrajectoryStore
from miles_engine.testing.dashboard_run import GAP_TOKEN, append_step, make_record, write_run

pytest.importorskip("fastapi")
pytest.importorskip("plotly")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("dash") / "run", steps=10, groups=30)


@pytest.fixture(scope="module")
def client(run: Path):
    from fastapi.testclient import TestClient

    from miles_engine.dashboard.app import create_app

    return TestClient(create_app([run]))


def test_not_a_run_is_one_clear_cli_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, why in ((empty, "neither metrics.jsonl nor trajectories.mtr"), (tmp_path / "nope", "no such directory")):
        result = CliRunner().invoke(cli, ["dashboard", str(path)])
        assert result.exit_code != 0
        assert str(path) in result.output and why in result.output and "Traceback" not in result.output
    with pytest.raises(NotARunError, match="not a directory"):
        check_run_dir(Path(__file__))


def test_not_a_run_through_the_real_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "dashboard", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(tmp_path) in lines[0] and "not a run directory" in lines[0]


def test_port_in_use_is_one_clear_error(run: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["dashboard", str(run), "--port", str(port)])
    assert result.exit_code != 0
    assert f"port {port}" in result.output and "in use" in result.output and "--port 0" in result.output


def test_metrics_tail_skips_and_counts_bad_lines_and_waits_for_a_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "reward/mean": 0.1}\n{"step": 2, "kin\n[1, 2]\n{"step": 3')
    tail = MetricsTail(path)
    assert tail.refresh() == 1 and tail.bad_lines == 2
    with path.open("a") as fh:
        fh.write(', "kind": "train", "reward/mean": 0.3}\n')
    assert tail.refresh() == 1 and [r["step"] for r in tail.rows] == [1, 3]
    assert tail.refresh() == 0


def test_overview_counts_a_corrupt_metrics_line(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from miles_engine.dashboard.app import create_app

    run = write_run(tmp_path / "run", steps=5, groups=3)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write("{garbled\n")
    client = TestClient(create_app([run]))
    page = client.get("/")
    assert page.status_code == 200 and "1 unreadable line(s) in metrics.jsonl skipped" in page.text
    one_eval = client.get("/eval").text  # a single evaluation: its per-task table, nothing to compare
    assert 'id="per-task"' in one_eval and "eval-5" in one_eval and 'id="compare"' not in one_eval


def test_groups_and_follow(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=2, groups=5)
    view = RunView(run, 0)
    view.refresh()
    groups = view.groups(2)
    assert [g.group_id for g in groups] == [f"s2-g{i}" for i in range(5)]
    assert [g.group_id for g in view.groups(2, "zero_variance")] == ["s2-g0"]
    assert [g.group_id for g in view.groups(2, "filtered")] == ["s2-g0"]
    assert [g.group_id for g in view.groups(2, "failed")] == ["s2-g1"]
    assert groups[1].failed[0]["error"] == "sandbox exited (OOM)"
    before = view.version
    append_step(run, 3, steps=3, groups=5)
    assert view.refresh() and view.version != before and view.steps() == [1, 2, 3]
    assert view.data.series("reward/mean")[0] == [1, 2, 3]


def test_pages_render(client, run: Path) -> None:
    store = TrajectoryStore(run)
    store.refresh()
    rid = store.query(step=1, group_id="s1-g2", limit=1)[0][0]["rid"]
    assert client.get("/").status_code == 200
    step = client.get("/run/0/step/1")
    assert step.status_code == 200 and "page 1 of 2" in step.text and f"/run/0/traj/{rid}" in step.text
    assert "page 2 of 2" in client.get("/run/0/step/1?page_no=2").text
    ranked = client.get("/run/0/step/1?tsort=reward&tdesc=1").text.split('id="ranked-table"')[1]
    assert "page 1 of 6" in ranked and "status-failed" not in ranked  # 120 trajectories, 20 a page
    last = client.get("/run/0/step/1?tsort=reward&tdesc=1&tpage=6").text.split('id="ranked-table"')[1]
    assert "page 6 of 6" in last and last.count("status-failed") == 1  # no reward: last either way
    traj = client.get(f"/run/0/traj/{rid}")
    assert traj.status_code == 200 and "&lt;tool&gt;" in traj.text and "a&amp;b" in traj.text  # escaped pieces
    ev = client.get("/eval")
    assert ev.status_code == 200 and "eval/pass@1" in ev.text and "shared task(s)" in ev.text
    assert client.get("/run/0/traj/123456789").status_code == 404
    assert client.get("/run/9/step/1").status_code == 404
    js = client.get("/static-lib/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000  # the plotly package's own bundle


def test_curves_poll_answers_unchanged_until_the_run_grows(client) -> None:
    first = client.get("/api/curves").json()
    reward = next(c for c in first["charts"] if c["id"] == "reward")
    mean = next(t for t in reward["data"] if t["meta"]["key"] == "reward/mean")
    assert mean["x"] == list(range(1, 11))
    assert client.get("/api/curves", params={"v": first["version"]}).json() == {"version": first["version"],
                                                                               "unchanged": True}


def test_token_page_is_paged_and_shows_the_gap() -> None:
    _, body = make_record(1, 0, 0, tokens=10_000, reward=1.0, advantage=0.0, kind="single_turn")
    first = token_page(body, 1, per_page=4000)
    assert (first.pages, first.shown, first.first, first.paged) == (3, 4000, 0, True)
    assert first.html.count('class="tok"') == 4000 and 'data-gap="0.8"' in first.html
    last = token_page(body, 99, per_page=4000)  # past the end: the last page
    assert (last.page, last.first, last.shown) == (3, 8000, 2000)
    _, small = make_record(1, 0, 0, tokens=8, reward=1.0, advantage=0.0, kind="single_turn")
    small["trainer_logprobs"] = None
    page = token_page(small)
    assert not page.paged and not page.has_trainer and page.default_measure == "logprob"
    assert f'data-i="{GAP_TOKEN}"' in page.html and 'data-gap=""' in page.html


def test_core_package_imports_without_the_web_stack() -> None:
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['plotly'] = None; sys.modules['uvicorn'] = None\n"
            "import miles_engine.dashboard, miles_engine.dashboard.data, miles_engine.cli.dashboard_cmd\n"
            "from miles_engine.cli.main import cli")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_summary_only_record_shows_its_summary(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from miles_engine.dashboard.app import create_app
    from miles_engine.metrics.trajectory_store import TrajectoryWriter

    writer = TrajectoryWriter(tmp_path)
    writer.append([make_record(1, 0, 0, tokens=8, reward=0.0, advantage=0.0, kind="single_turn", body=False)])
    writer.close()
    page = TestClient(create_app([tmp_path])).get("/run/0/traj/0")
    assert page.status_code == 200 and "no body (summary only)" in page.text


def test_records_missing_fields_still_render(tmp_path: Path) -> None:
    """Only rid is sure: a writer that leaves fields out (or writes nulls) must not break the pages."""
    from fastapi.testclient import TestClient

    from miles_engine.dashboard.app import create_app
    from miles_engine.metrics.trajectory_store import TrajectoryWriter

    writer = TrajectoryWriter(tmp_path)
    writer.append([({"step": 1, "group_id": "g", "index": None}, {}), ({"step": 1, "group_id": "g"}, {}),
                   ({"step": None}, {})])
    writer.close()
    client = TestClient(create_app([tmp_path]))
    assert client.get("/").status_code == 200
    assert client.get("/run/0/step/1").status_code == 200 and client.get("/run/0/step/0").status_code == 200
    assert client.get("/run/0/traj/0").status_code == 200
