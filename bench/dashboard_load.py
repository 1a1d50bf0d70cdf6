"""How fast `miles dashboard` pages load over a big run, measured in headless Chromium.

Builds a synthetic run of ``--trajectories`` records (default 100K, written with the real
TrajectoryWriter and MetricsLogger), starts ``miles dashboard`` on it, and loads the overview, a
step's groups page and a trajectory page ``--repeats`` times each, reading the browser's own
Performance API: ``load`` (navigation start to the load event's end) and first contentful paint.
The first overview load also fetches plotly.min.js (4.8 MB); later loads have it cached, as a
reader's browser would. Prints a table of medians and ranges.

    .venv/bin/python bench/dashboard_load.py [--trajectories 100000] [--repeats 5] [--screenshots DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.metrics.trajectory_store import TrajectoryStore  # noqa: E402
from miles_engine.testing import browser as B  # noqa: E402
from miles_engine.testing.dashboard_run import add_huge_trajectory, write_run  # noqa: E402

HUGE_TOKENS = 200_000  # one more trajectory, in the last step: the token view pages it

# async: a paint entry is queued after the frame is presented, possibly after the script saw the page ready
TIMING_JS = """
const done = arguments[arguments.length - 1];
const nav = performance.getEntriesByType('navigation')[0];
const answer = (fcp) => done({load: nav.loadEventEnd - nav.startTime, fcp: fcp});
const seen = performance.getEntriesByName('first-contentful-paint')[0];
if (seen) { answer(seen.startTime); } else {
  new PerformanceObserver((list) => {
    const e = list.getEntriesByName('first-contentful-paint')[0];
    if (e) answer(e.startTime);
  }).observe({type: 'paint', buffered: true});
  setTimeout(() => answer(null), 3000);
}
"""


def build(run_dir: Path, trajectories: int, group_size: int, groups: int, tokens: int) -> float:
    steps = max(1, trajectories // (group_size * groups))
    t0 = time.perf_counter()
    write_run(run_dir, steps=steps, groups=groups, group_size=group_size, tokens=tokens, eval_every=10)
    add_huge_trajectory(run_dir, step=steps, tokens=HUGE_TOKENS)
    return time.perf_counter() - t0


def measure(driver, url: str, repeats: int, ready_js: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"load": [], "fcp": [], "ready": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        driver.get(url)
        B.wait_for(lambda: driver.execute_script(ready_js), 60, f"{url} ready", interval_s=0.02)
        ready = (time.perf_counter() - t0) * 1000
        B.wait_for(lambda: driver.execute_script("return document.readyState === 'complete'"), 60, "load event")
        timing = driver.execute_async_script(TIMING_JS)
        out["load"].append(timing["load"])
        out["fcp"].append(timing["fcp"] or float("nan"))
        out["ready"].append(ready)
    return out


def cell(values: list[float]) -> str:
    values = [v for v in values if v == v]  # a paint the browser never reported is left out
    if not values:
        return "n/a"
    return f"{statistics.median(values):7.0f} ({min(values):.0f}–{max(values):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=100_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=125, help="groups per step")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per trajectory")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--screenshots", type=Path, default=None, help="save a screenshot of each page here")
    ap.add_argument("--keep", type=Path, default=None, help="build the run here (and keep it)")
    args = ap.parse_args()
    missing = B.missing_browser()
    if missing:
        sys.exit(f"cannot measure: {missing}")
    with tempfile.TemporaryDirectory(prefix="dash-bench-") as tmp:
        run = args.keep or Path(tmp) / "run"
        if not (run / "trajectories.mtr").exists():
            took = build(run, args.trajectories, args.group_size, args.groups, args.tokens)
            print(f"built {run}: {args.trajectories} trajectories in {took:.1f}s, "
                  f"{(run / 'trajectories.mtr').stat().st_size / 1e6:.0f} MB")
        store = TrajectoryStore(run)
        store.refresh()
        steps = store.steps()
        mid = steps[len(steps) // 2]
        rid = store.query(step=mid, limit=1, offset=args.group_size * 3)[0][0]["rid"]
        huge = store.query(sort="tokens", descending=True, limit=1)[0][0]
        t0 = time.perf_counter()
        server = B.DashboardProcess([run], start_timeout_s=600)
        print(f"dashboard up in {time.perf_counter() - t0:.1f}s over {len(store.summaries)} trajectories "
              f"({len(steps)} steps)")
        driver = B.start_chromium(B.fresh_profile(Path(tmp)))
        pages = [("overview", "/", "return !!(document.getElementById('chart-reward') || {}).data"),
                 (f"step {mid} ({args.groups} groups, page 1)", f"/run/0/step/{mid}",
                  "return document.querySelectorAll('#groups tr.group').length > 0"),
                 (f"trajectory ({args.tokens} tokens)", f"/run/0/traj/{rid}",
                  "return document.querySelectorAll('#tokens .tok').length > 0"),
                 (f"trajectory ({huge['tokens'] // 1000}K tokens, page 1)", f"/run/0/traj/{huge['rid']}",
                  "return document.querySelectorAll('#tokens .tok').length > 0")]
        try:
            rows = []
            for name, path, ready in pages:
                figures = measure(driver, server.url + path, args.repeats, ready)
                rows.append((name, figures))
                if args.screenshots:
                    args.screenshots.mkdir(parents=True, exist_ok=True)
                    driver.save_screenshot(str(args.screenshots / f"{len(rows)}-{name.split()[0]}.png"))
        finally:
            driver.quit()
            server.stop()
    print(f"\n{'page':<32} {'load ms: median (range)':>26} {'first contentful paint ms':>28} "
          f"{'ready ms (script saw it drawn)':>32}")
    for name, f in rows:
        print(f"{name:<32} {cell(f['load']):>26} {cell(f['fcp']):>28} {cell(f['ready']):>32}")
    print(f"({args.repeats} loads each, headless Chromium on this machine; the first overview load fetches plotly.min.js)")


if __name__ == "__main__":
    main()
