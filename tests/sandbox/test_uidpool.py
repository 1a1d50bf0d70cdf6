"""The uid pool's lock-file marker: a uid released clean is leased again without a /proc scan;
one whose owner died (marker left busy) is scanned."""

from __future__ import annotations

import os

import pytest

from miles_engine.sandbox.local import uidpool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the uid pool is used as root only")

BASE = 3_900_000  # far from the default pool (2_000_000 + 65_536) so no live sandbox holds it


@pytest.fixture
def scans(monkeypatch, tmp_path):
    monkeypatch.setattr(uidpool, "_lock_dir", lambda: str(tmp_path))
    seen: list[int] = []

    def find_processes(uid=None, **_):
        seen.append(uid)
        return []

    monkeypatch.setattr(uidpool.procscan, "find_processes", find_processes)
    return seen


def test_clean_release_skips_the_scan_on_every_later_lease(scans):
    for _ in range(3):  # the marker must survive being overwritten by busy and back
        lease = uidpool.lease_uid(BASE, 1)
        assert lease.uid == BASE
        lease.release(clean=True)
    assert scans == []


def test_a_lease_left_busy_is_scanned_next_time(scans, tmp_path):
    lease = uidpool.lease_uid(BASE, 1)
    lease.release(clean=False)  # e.g. leftovers were found at close
    uidpool.lease_uid(BASE, 1).release(clean=True)
    assert scans == [BASE]
    assert (tmp_path / f"{BASE}.lock").read_bytes() == b"clean"


def test_old_markers_from_before_the_fix_are_scanned(scans, tmp_path):
    (tmp_path / f"{BASE}.lock").write_bytes(b"busyn")
    uidpool.lease_uid(BASE, 1).release(clean=True)
    assert scans == [BASE]
