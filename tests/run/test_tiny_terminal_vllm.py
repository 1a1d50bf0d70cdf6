"""The packaged tiny-terminal recipe with its engine swapped for a real vLLM server (the CPU build
in its own environment, ``./dev.sh vllm``), from the SFT weights (the shared ``warm_run``'s step-0
checkpoint), 30 RL steps, and the learning bar of the other tiny-terminal e2e tests
(tests/run/learning.py: held-out reward after 30 steps above the SFT weights', paired).

Every push goes through vLLM's weight-transfer API into the bridge's gloo backend and is checked
equal (``weights.check_update_equal``); the engine-trainer log-prob gap on the sampled tokens is
logged every step (vLLM's kernels are not the trainer's: the mismatch correction sees the gap).
Sync rollouts, so every token is sampled under the trainer's current weights and the gap measures
numerics alone (``tis/numerics_abs_diff``; fully async, the same gap lands in ``tis/stale_*``).

Past step 10 the vLLM server process is SIGKILLed: its supervisor starts another, restores the
trainer's current weights into it, the requests in flight are sent again, and the run goes on with
every group trained once or accounted for, every later push checked."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from miles_engine.engines.vllm.options import default_python
from tests.run.fleet_helpers import assert_accounted, vllm_pid
from tests.run.learning import assert_held_out_rise, rl_from_sft_weights

STEPS = 30
VLLM = "engines=[{kind: vllm, options: {cpu_kv_cache_gib: 1, max_num_seqs: 64}}]"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not Path(default_python()).is_file(),
                                 reason=f"no vLLM environment at {default_python()} (./dev.sh vllm builds it)")]


def _kill_past_step(run: Path, step: int, killed: list[int], stop: threading.Event) -> None:
    while not stop.wait(0.2):
        metrics = run / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        pid = vllm_pid(run)
        if pid is not None and any(r["kind"] == "train" and r["step"] >= step for r in rows):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return


def test_tiny_terminal_learns_on_a_vllm_engine(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "vllm"
    killed: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_kill_past_step, args=(run, 10, killed, stop), daemon=True)
    watcher.start()
    try:
        train = rl_from_sft_weights(warm_run, run, STEPS, VLLM, "weights.transport=broadcast",
                                    "weights.check_update_equal=true", "rollout.mode=sync", "run.checkpoint_every=30")
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert killed, "the vLLM process was never found to kill"
    assert train[-1]["engines/restarts"] >= 1, {k: v for k, v in train[-1].items() if k.startswith("engines/")}
    assert vllm_pid(run) is None  # nothing left running after the run
    assert_accounted(run, train)
    assert "kind: vllm" in (run / "config.yaml").read_text()
    assert_held_out_rise(run, train, " on a vLLM engine")
    assert all(r["tis/numerics_tokens"] > 0 for r in train), [r["tis/numerics_tokens"] for r in train]
    gaps = sorted(r["tis/numerics_abs_diff"] for r in train)
    # float32 kernels of two implementations: a small gap, never a wrong token (a stale cache, a lost push)
    assert gaps[len(gaps) // 2] < 0.05 and max(r["tis/numerics_max_abs_diff"] for r in train) < 1.0, gaps
    assert all(r["weights/tensors_checked"] > 0 for r in train if "weights/tensors_checked" in r)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for r in rows if "weights/tensors_checked" in r) >= STEPS // 2, "pushes were not checked"

