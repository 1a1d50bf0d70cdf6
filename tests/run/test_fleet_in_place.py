"""``rollout.on_update=in_place`` on a fleet of two ``server`` engine processes (tiny-terminal resumed
from the shared warm run, 12 RL steps, broadcast pushes) while one engine process is SIGKILLed
mid-run: a module of its own so the suite's workers can run it beside the other on_update runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run.fleet_helpers import assert_accounted, engine_pid, metric_rows, resume_with, sigkill_engine_after


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_place_through_an_engine_sigkill(warm_run: Path, tmp_path: Path) -> None:
    """Two ``server`` engine processes, ``in_place``: past step 4 one is SIGKILLed while its requests
    decode. Its supervisor starts another with the current weights; the requests it held are
    re-sent; every group is trained once or accounted, and every recorded token's version is one
    the run had pushed by then, never decreasing along a trajectory."""
    from miles_engine.metrics.trajectory_store import TRAJECTORIES_FILE, read_body, scan

    killed: list[int] = []

    run = resume_with(warm_run, tmp_path / "run", ["rollout.on_update=in_place", "weights.transport=broadcast", "run.steps=13",
                                                   "run.checkpoint_every=13", "metrics.trajectories=all"],
                      while_running=sigkill_engine_after(4, "server-0", killed))
    assert killed, "the engine process was never found to kill"
    train = [r for r in metric_rows(run) if r["step"] > 1]
    assert [r["step"] for r in train] == list(range(2, 14))
    assert train[-1]["engines/server-0/restarts"] >= 1
    # the engine processes say what each push's pause did: running requests kept, none put back
    assert all(r.get("engines/retracted", 0) == 0 and r.get("engines/aborted", 0) == 0 for r in train)
    assert sum(r.get("engines/kept_in_place", 0) for r in train) > 0
    assert sum(r.get("engines/server-1/kept_in_place", 0) for r in train) > 0
    assert max(r.get("buffer/taken/delta_gen_max", 0.0) for r in train) >= 1
    assert_accounted(run, train)
    assert engine_pid(run, "server-0") is None  # nothing left running after the run

    version_after = {r["step"]: int(r["weights/version"]) for r in metric_rows(run)}
    path = run / TRAJECTORIES_FILE
    spanned = 0
    for offset, summary in scan(path).records:
        if not summary["has_body"] or summary["filtered"] is not None:
            continue
        body = read_body(path, offset)
        sampled = [v for v, m in zip(body["weight_versions"], body["loss_mask"]) if m]
        assert sampled == sorted(sampled), f"{summary['group_id']}: a token older than the one before it"
        assert sampled[-1] <= version_after[summary["step"]]  # sampled by weights pushed before its step
        assert summary["versions"] == [sampled[0], sampled[-1]]
        spanned += sampled[0] != sampled[-1]
    assert spanned > 0, "no trajectory spans a push"

