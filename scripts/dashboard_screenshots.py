"""Regenerates the README's dashboard screenshots (docs/img/dashboard-*.png) in headless Debian
Chromium: the overview of a synthetic 40-step run, and a trajectory of the synthetic run or, with
``--trajectory-from RUN_DIR``, a multi-turn tool-using trajectory a real run recorded
(``metrics.trajectories=all``):  .venv/bin/python scripts/dashboard_screenshots.py [--trajectory-from RUN_DIR]"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles_engine.metrics.trajectory_store import TrajectoryStore  # noqa: E402
from miles_engine.testing import browser as B  # noqa: E402
from miles_engine.testing.dashboard_run import write_run  # noqa: E402


def _real_trajectory(run: Path) -> int:
    store = TrajectoryStore(run)
    store.refresh()
    chosen = [s for s in store.summaries if s.get("has_body") and s.get("tool_calls", 0) > 0 and s.get("turns", 0) > 1]
    if not chosen:
        sys.exit(f"{run}: no recorded multi-turn trajectory with tool calls and a body")
    return max(chosen, key=lambda s: (s.get("reward") or 0.0, s["turns"]))["rid"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trajectory-from", type=Path, default=None, help="a real run with recorded bodies")
    args = parser.parse_args()
    missing = B.missing_browser()
    if missing:
        sys.exit(missing)
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = write_run(Path(tmp) / "tiny-terminal-demo", steps=40, groups=16, group_size=8, tokens=360)
        store = TrajectoryStore(run)
        store.refresh()
        rid = store.query(step=30, group_id="s30-g3", limit=1)[0][0]["rid"]
        server = B.DashboardProcess([run], follow=True)
        driver = B.start_chromium(B.fresh_profile(Path(tmp)))
        try:
            driver.get(server.url + "/")
            B.wait_for(lambda: driver.execute_script("return !!(document.getElementById('chart-time') || {}).data"),
                       30, "the overview's charts")
            time.sleep(1)  # Plotly's transitions
            driver.save_screenshot(str(out / "dashboard-overview.png"))
            if args.trajectory_from is not None:  # a real run's trajectory, on a dashboard of its own
                server.stop()
                rid = _real_trajectory(args.trajectory_from)
                server = B.DashboardProcess([args.trajectory_from])
            driver.get(f"{server.url}/run/0/traj/{rid}")
            B.wait_for(lambda: driver.execute_script("return !!(document.getElementById('timeline') || {}).data"),
                       30, "the trajectory's timeline")
            time.sleep(0.5)
            driver.save_screenshot(str(out / "dashboard-trajectory.png"))
        finally:
            driver.quit()
            server.stop()
    print(f"wrote {out}/dashboard-overview.png and dashboard-trajectory.png")


if __name__ == "__main__":
    main()
