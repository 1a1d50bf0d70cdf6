"""Our weight-sync group and SGLang's: a process that joins the way SGLang's
``init_custom_process_group`` does (torch's ``rendezvous`` on ``tcp://``, a ``PrefixStore(group_name)``,
torch's ``_new_process_group_helper``, ``dist.broadcast(..., group=pg)`` -- its
``/init_weights_update_group`` and ``/update_weights_from_distributed``) receives what our rank 0
broadcasts. Before the key layout matched, such a join waited for keys nobody wrote."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import torch

from miles_engine.weights import dist as wdist

SGLANG_SIDE = textwrap.dedent("""
    import datetime, sys, torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    port, name = int(sys.argv[1]), sys.argv[2]
    timeout = datetime.timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), store, group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    t = torch.empty(5)
    dist.broadcast(t, src=0, group=pg)
    print(t.tolist())
""")


def test_a_process_joining_as_sglang_does_receives_our_broadcast():
    store = wdist.master_store("127.0.0.1", 2, 60.0)
    peer = subprocess.Popen([sys.executable, "-c", SGLANG_SIDE, str(store.port), "weights-g"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    joined: list = []
    t = threading.Thread(target=lambda: joined.append(wdist.new_group(
        "gloo", master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2, group_name="weights-g",
        timeout_s=60.0, store=store)), daemon=True)
    t.start()
    t.join(90)
    assert joined, f"our rank 0 never joined; the peer said: {peer.stderr.read() if peer.poll() is not None else ''}"
    wdist.broadcast(joined[0], torch.arange(5, dtype=torch.float32))
    out, err = peer.communicate(timeout=90)
    assert peer.returncode == 0, err[-2000:]
    assert out.strip() == "[0.0, 1.0, 2.0, 3.0, 4.0]"
    wdist.abort_group(joined[0])
