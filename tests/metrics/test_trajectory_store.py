"""The trajectory record file: framing, torn tails, corrupt records, paging and filters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from miles_engine.metrics.trajectory_store import TRAJECTORIES_FILE, TrajectoryStore, TrajectoryWriter


def _rec(step: int, i: int, reward: float) -> tuple[dict, dict]:
    return ({"step": step, "group_id": f"g{step}", "index": i, "task_id": f"t{i % 3}", "reward": reward,
             "status": "ok", "tokens": 3 + i},
            {"token_ids": list(range(3 + i)), "pieces": ["a"] * (3 + i)})


def test_records_read_back_paged_filtered_and_sorted(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append(_rec(1, i, i / 10) for i in range(8))
    store = TrajectoryStore(tmp_path)
    assert store.refresh() == 8 and store.steps() == [1]
    w.append(_rec(2, i, -i) for i in range(4))
    assert store.refresh() == 4 and store.refresh() == 0 and store.steps() == [1, 2]
    page, total = store.query(step=1, sort="reward", descending=True, offset=1, limit=3)
    assert total == 8 and [r["index"] for r in page] == [6, 5, 4]
    page, total = store.query(task_id="t0")
    assert total == 5 and all(r["task_id"] == "t0" for r in page)
    whole = store.get(page[0]["rid"])
    assert whole["token_ids"] == list(range(3)) and whole["step"] == 1
    with pytest.raises(ValueError, match="unknown filter.*allowed: step"):
        store.query(color="red")
    with pytest.raises(KeyError):
        store.get(12345)
    w.close()


def test_a_torn_tail_is_skipped_counted_and_cut_by_the_next_writer(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([_rec(1, 0, 1.0), _rec(1, 1, 0.0)])
    w.close()
    path = tmp_path / TRAJECTORIES_FILE
    whole = path.read_bytes()
    path.write_bytes(whole + whole[:30])  # half a record: a crash mid-write
    store = TrajectoryStore(tmp_path)
    assert store.refresh() == 2 and store.torn_bytes == 30
    w = TrajectoryWriter(tmp_path)  # --resume: the torn tail goes before anything is appended
    assert w.repaired_bytes == 30
    w.append([_rec(2, 0, 0.5)])
    w.close()
    fresh = TrajectoryStore(tmp_path)
    assert fresh.refresh() == 3 and fresh.torn_bytes == 0 and fresh.corrupt == 0


def test_a_corrupt_record_is_skipped_and_the_rest_still_read(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([_rec(1, i, 0.0) for i in range(3)])
    w.close()
    path = tmp_path / TRAJECTORIES_FILE
    data = bytearray(path.read_bytes())
    store = TrajectoryStore(tmp_path)
    store.refresh()
    second = store.summaries[1]["rid"]
    data[second + 20] ^= 0xFF  # a flipped byte inside the second record's summary
    path.write_bytes(bytes(data))
    again = TrajectoryStore(tmp_path)
    assert again.refresh() == 2 and again.corrupt == 1
    assert [s["index"] for s in again.summaries] == [0, 2]


def test_sigkill_while_writing_leaves_a_readable_file(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from miles_engine.metrics.trajectory_store import TrajectoryWriter
        w = TrajectoryWriter({str(tmp_path)!r})
        big = {{"token_ids": list(range(20000)), "pieces": ["x" * 7] * 20000}}
        step = 0
        while True:
            step += 1
            w.append([({{"step": step, "group_id": "g", "index": i}}, big) for i in range(4)])
            if step == 3:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    store = TrajectoryStore(tmp_path)
    n = store.refresh()
    assert n >= 12 and store.corrupt == 0
    assert all(len(store.get(s["rid"])["token_ids"]) == 20000 for s in store.summaries[-2:])
