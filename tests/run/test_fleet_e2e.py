"""tiny-terminal on a fleet of `server` engine processes behind the router, one run: it learns over
the disk_delta transport with every push checked tensor by tensor, evaluated meanwhile by a
dedicated `server` eval engine, while one engine process is SIGKILLed mid-run and restarted with
the current weights, the run going on with every group accounted for.

The SFT warm start runs once per session (``warm_run`` in conftest: the recipe as shipped, then
1 RL step on the embedded engine); the run resumes a copy of that run directory with another
fleet and transport (both may change on resume: engines start from the trainer's weights) for 30
more RL steps. Bounded by steps; the recipe's wall-clock limit is lifted. Learning over the
broadcast transport, through an engine kill too, is asserted by tests/run/test_ray_e2e.py (the
same server engines and push, in Ray actors).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.run.fleet_helpers import (
    assert_accounted,
    assert_learns,
    engine_pid,
    metric_rows,
    resume_with,
    sigkill_engine_after,
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_server_engines_learn_through_a_sigkill(warm_run: Path, tmp_path: Path) -> None:
    """Also evaluation in dedicated mode on a `server` engine of its own (issue 18): every 10 steps
    it gets a snapshot by broadcast and evaluates 32 held-out drills while training goes on; the
    held-out reward rises (paired difference, step 30 - step 1, 95% interval above 0). Past step 5
    the process of engine server-0 is SIGKILLed: its supervisor starts another with the trainer's
    current weights, and from its first push on every push reaches both engines, checked."""
    killed: list[int] = []

    run = resume_with(warm_run, tmp_path / "run", ["weights.transport=disk_delta", "weights.check_update_equal=true",
                                                   "eval.every=10", "eval.mode=dedicated", "eval.engine.kind=server",
                                                   "eval.limit=32", "eval.attempts=4"],
                      while_running=sigkill_engine_after(5, "server-0", killed))
    assert killed, "the engine process was never found to kill"
    train = assert_learns(run, one_outage=True)
    assert_accounted(run, train)
    assert_dedicated_eval(run, train)
    assert train[-1]["engines/server-0/restarts"] >= 1 and train[-1]["engines/restarts"] >= 1
    assert engine_pid(run, "server-0") is None  # nothing left running after the run
    # after the restart the engine got the current weights: every later push was checked tensor by tensor
    # (the replacement process may take a few steps to start on a loaded box: from its first push on,
    # every push reached both engines and was checked)
    after = [r for r in train if r["engines/server-0/restarts"] >= 1]
    assert after and all(r["weights/tensors_checked"] > 0 for r in after)
    back = next((i for i, r in enumerate(after) if r["weights/engines"] == 2), None)
    assert back is not None, "the restarted engine never received a push"
    assert all(r["weights/engines"] == 2 for r in after[back:])
    assert sum(r["engines/server-0/requests"] for r in after[back:]) > 0  # it served again


def assert_dedicated_eval(run: Path, train: list[dict]) -> None:
    from miles_engine.evaluation.runner import read_records

    evals = {r["step"]: r for r in metric_rows(run, "eval")}
    assert sorted(evals) == [1, 10, 20, 30]  # the resumed step (eval.at_start), then the multiples of 10
    versions = {r["step"]: int(r["weights/version"]) for r in metric_rows(run)}
    records = {}
    for step, row in evals.items():
        assert row["eval/failed"] == 0 and row["eval/weight_version"] == versions[step] and row["eval/lag_steps"] >= 0
        records[step] = read_records(run / "eval" / f"step_{step:06d}.jsonl")
        assert all(r.weight_versions == [versions[step]] for r in records[step] if r.ok)  # the snapshot's weights
    held_out = {r.task_id for rs in records.values() for r in rs}
    trained = {g.rsplit("@", 1)[0] for line in (run / "consumed.jsonl").read_text().splitlines()
               for g in json.loads(line)["groups"]}
    assert len(held_out) == 32 and not held_out & trained
    assert (run / "eval" / "engines" / "eval-0").is_dir()  # the eval engine process's own state
    # that the held-out reward rose from step 1 to 30: assert_learns

