"""`miles dashboard` in a real headless Chromium: one dashboard process and one browser for the module.

The dashboard serves three synthetic runs written with the real writers, with --follow:
0 ``finished`` (STEPS steps, 60 groups a step, one 200K-token trajectory), 1 ``live`` (the test
appends a step while the page is open), 2 ``doomed`` (removed by the last test while served).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_engine.metrics.trajectory_store import TrajectoryStore
from miles_engine.testing import browser as B
from miles_engine.testing.dashboard_run import GAP_TOKEN, add_huge_trajectory, append_step, pieces_of, write_run

pytest.importorskip("fastapi")
pytest.importorskip("plotly")

STEPS = 12
GROUPS = 60  # 25 a page: three pages
HUGE_TOKENS = 200_000
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dashboard-runs")
    finished = write_run(root / "finished", steps=STEPS, groups=GROUPS)
    add_huge_trajectory(finished, step=1, tokens=HUGE_TOKENS)
    live = write_run(root / "live", steps=1, groups=3)
    doomed = write_run(root / "doomed", steps=2, groups=2)
    return {"finished": finished, "live": live, "doomed": doomed}


@pytest.fixture(scope="module")
def server(runs: dict[str, Path]) -> Iterator[B.DashboardProcess]:
    proc = B.DashboardProcess([runs["finished"], runs["live"], runs["doomed"]], follow=True)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    missing = B.missing_browser()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the dashboard's browser tests cannot run under CI: {missing}")
        pytest.skip(missing)
    d = B.start_chromium(B.fresh_profile(tmp_path_factory.mktemp("browser")))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("MILES_TEST_ARTIFACTS")
    path = Path(root) / "dashboard" if root else tmp_path_factory.mktemp("dashboard-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _points(driver: Any, chart: str, run: int, key: str) -> int:
    return driver.execute_script(
        "const d = document.getElementById(arguments[0]);"
        "if (!d || !d.data) return -1;"
        "const t = d.data.find(t => t.meta && t.meta.run === arguments[1] && t.meta.key === arguments[2] && !t.meta.band);"
        "return t ? t.x.length : -1;", f"chart-{chart}", run, key)


def _rid(run_dir: Path, **filters: Any) -> int:
    store = TrajectoryStore(run_dir)
    store.refresh()
    page, _ = store.query(limit=1, **filters)
    return int(page[0]["rid"])


def test_overview_draws_one_reward_point_per_step(server: B.DashboardProcess, driver: Any, artifacts: Path) -> None:
    driver.get(server.url + "/")
    B.wait_for(lambda: _points(driver, "reward", 0, "reward/mean") >= 0, 20, "the reward chart drawn")
    assert _points(driver, "reward", 0, "reward/mean") == STEPS
    assert _points(driver, "reward", 0, "reward/single_turn") == STEPS  # per task kind
    assert _points(driver, "reward", 1, "reward/mean") == 1  # the live run, overlaid
    bands = driver.execute_script("return document.getElementById('chart-eval').data"
                                  ".filter(t => t.meta.band && t.fill === 'tonexty').length")
    assert bands >= 2  # eval/reward and eval/pass@1 intervals of the finished run
    drawn = set(driver.execute_script("return Array.from(document.querySelectorAll('.chart')).map(d => d.id)"))
    assert {"chart-reward", "chart-eval", "chart-staleness", "chart-tis", "chart-gap", "chart-truncation",
            "chart-engine", "chart-sandbox", "chart-time"} <= drawn
    driver.save_screenshot(str(artifacts / "overview.png"))


def test_trajectory_shows_exact_tokens_and_gap_colours(runs: dict[str, Path], server: B.DashboardProcess,
                                                        driver: Any, artifacts: Path) -> None:
    rid = _rid(runs["finished"], step=2, group_id="s2-g2")
    driver.get(f"{server.url}/run/0/traj/{rid}")
    pieces = driver.execute_script("return Array.from(document.querySelectorAll('#tokens .tok')).map(s => s.textContent)")
    assert pieces == pieces_of(40)
    colour = ("return getComputedStyle(document.querySelectorAll('#tokens .tok')[arguments[0]]).backgroundColor")
    assert driver.execute_script("return document.getElementById('measure').value") == "gap"
    high, zero = driver.execute_script(colour, GAP_TOKEN), driver.execute_script(colour, GAP_TOKEN + 1)
    assert high != zero and zero == "rgb(255, 255, 255)"
    title = driver.execute_script(f"return document.querySelectorAll('#tokens .tok')[{GAP_TOKEN}].title")
    assert f"id {1000 + GAP_TOKEN}" in title and "gap 0.8" in title
    driver.execute_script("const s = document.getElementById('measure'); s.value = 'mask';"
                          "s.dispatchEvent(new Event('change'));")
    assert driver.execute_script(colour, 0) != driver.execute_script(colour, 39)  # prompt vs sampled
    assert "ls -la" in driver.find_element("id", "conversation").text
    assert driver.execute_script("return document.getElementById('timeline').data[0].x.length") == 2
    driver.save_screenshot(str(artifacts / "trajectory.png"))


def test_groups_table_pages_and_flags(server: B.DashboardProcess, driver: Any, artifacts: Path) -> None:
    driver.get(f"{server.url}/run/0/step/2")
    rows = lambda: driver.execute_script(  # noqa: E731
        "return Array.from(document.querySelectorAll('#groups tr.group')).map(r => r.dataset.group)")
    first = rows()
    assert len(first) == 25 and "page 1 of 3" in driver.find_element("id", "pager").text
    assert "zero variance" in driver.find_element("css selector", "tr[data-group='s2-g0']").text
    assert "filtered: zero_std" in driver.find_element("css selector", "tr[data-group='s2-g0']").text
    assert "sandbox exited (OOM)" in driver.find_element("css selector", "tr[data-group='s2-g1']").text
    driver.save_screenshot(str(artifacts / "step.png"))
    driver.find_element("id", "next-page").click()
    B.wait_for(lambda: "page 2 of 3" in driver.find_element("id", "pager").text, 20, "page 2")
    second = rows()
    assert len(second) == 25 and not set(first) & set(second)
    driver.get(f"{server.url}/run/0/step/2?show=zero_variance")
    assert rows() == ["s2-g0"]


def test_live_run_extends_the_chart_without_reload(runs: dict[str, Path], server: B.DashboardProcess,
                                                  driver: Any) -> None:
    driver.get(server.url + "/")
    B.wait_for(lambda: _points(driver, "reward", 1, "reward/mean") == 1, 20, "the live run's first step drawn")
    driver.execute_script("window.__notReloaded = true;")
    append_step(runs["live"], 2, steps=3, groups=3)
    B.wait_for(lambda: _points(driver, "reward", 1, "reward/mean") == 2, 30, "the live run's new step drawn")
    assert driver.execute_script("return window.__notReloaded === true")
    assert "live: step 2" in driver.find_element("id", "live").text
    assert _points(driver, "reward", 0, "reward/mean") == STEPS


def test_huge_trajectory_is_paged(runs: dict[str, Path], server: B.DashboardProcess, driver: Any) -> None:
    rid = _rid(runs["finished"], step=1, group_id="s1-g999")
    driver.get(f"{server.url}/run/0/traj/{rid}")
    notice = driver.find_element("id", "token-notice").text
    assert f"{HUGE_TOKENS} tokens: paged" in notice and "page 1 of 50" in notice
    assert driver.execute_script("return document.querySelectorAll('#tokens .tok').length") == 4000
    driver.find_element("id", "tokens-next").click()
    B.wait_for(lambda: "page 2 of 50" in driver.find_element("id", "token-notice").text, 20, "token page 2")
    first = driver.execute_script("return document.querySelector('#tokens .tok').dataset.i")
    assert first == "4000"


def test_removed_run_shows_one_clear_error_page(runs: dict[str, Path], server: B.DashboardProcess,
                                               driver: Any) -> None:
    """Last: the run goes away for good (and the overview, which shows it, too)."""
    driver.get(f"{server.url}/run/2/step/1")
    assert driver.find_elements("id", "groups")
    shutil.rmtree(runs["doomed"])
    driver.get(f"{server.url}/run/2/step/1")
    text = driver.find_element("id", "error").text
    assert "was removed" in text and str(runs["doomed"]) in text and "Traceback" not in driver.page_source
    driver.get(server.url + "/")
    assert "was removed" in driver.find_element("id", "error").text
    assert server.proc.poll() is None  # the dashboard still serves
