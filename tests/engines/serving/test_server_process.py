"""A server's process group is signalled only while it is ours: once its leader is reaped, the
group id is free for another process's group (pids wrap around), so the stragglers are killed
at the reap and the id is never signalled again."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from miles_engine.engines import launch
from miles_engine.engines.launch import ServerProcess


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_reaped_group_is_swept_at_once_and_never_signalled_again(tmp_path: Path, monkeypatch) -> None:
    server = ServerProcess(["sh", "-c", "sleep 300 & echo $! > straggler; exit 0"], port=1, cwd=tmp_path,
                           log_path=tmp_path / "log")
    server.spawn()
    for _ in range(500):  # bounded by count: the leader exits at once
        if not server.alive() and (tmp_path / "straggler").exists():
            break
        time.sleep(0.02)
    straggler = int((tmp_path / "straggler").read_text())
    for _ in range(250):
        if _gone(straggler):
            break
        time.sleep(0.02)
    assert _gone(straggler), "the leader's exit left its group running"

    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(launch.os, "killpg", lambda pgid, sig: signalled.append((pgid, sig)))
    assert asyncio.run(server.stop(grace_s=0.1)) == 0
    server.kill()
    assert server.returncode == 0 and signalled == []

    server.argv = ["sleep", "300"]  # a new process: its group is ours again
    server.spawn()
    try:
        server.kill()
        assert signalled and signalled[0][0] == server.pid
    finally:
        monkeypatch.undo()
        server.kill()
    assert server.returncode is not None


@pytest.mark.parametrize("leader", ["exits on TERM", "ignores TERM"])
def test_stop_leaves_nothing_of_the_group(tmp_path: Path, leader: str) -> None:
    trap = "trap '' TERM; " if leader == "ignores TERM" else ""
    server = ServerProcess(["sh", "-c", f"{trap}(trap '' TERM; exec sleep 300) & echo $! > straggler; wait"],
                           port=1, cwd=tmp_path, log_path=tmp_path / "log")
    server.spawn()
    for _ in range(500):
        if (tmp_path / "straggler").exists() and (tmp_path / "straggler").read_text().strip():
            break
        time.sleep(0.02)
    straggler = int((tmp_path / "straggler").read_text())
    asyncio.run(server.stop(grace_s=0.5))
    assert not server.alive()
    for _ in range(250):
        if _gone(straggler):
            break
        time.sleep(0.02)
    assert _gone(straggler)
