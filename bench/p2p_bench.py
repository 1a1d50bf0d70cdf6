"""weights.transport p2p vs broadcast on this box (prints a table; not a test).

    PYTHONPATH=. .venv/bin/python bench/p2p_bench.py [--repeats 3] [--layouts 1x2,2x2,2x4,2x2half]

For each layout SxT: an FSDP2 trainer of S ranks (a ~25M-parameter Qwen3, float32) and T engine
processes (our server, one thread each). Per push, interleaved with the other transport:

- ``broadcast``: the trainer's export gathered to rank 0 and sent to the driver, which broadcasts
  every tensor to every engine (the driver is rank 0 of the group);
- ``p2p``: every rank gathers a full copy and writes to the engines the plan gives it
  (``weights.p2p``); the driver sends no tensor.

``half``: every second engine declares only the odd layers (a partial layout, as an engine holding
half of a MoE's experts would): p2p sends it only those; broadcast sends everything to everyone.
Columns: seconds per update (export + transfer + commit, median [range]), bytes each engine
received, bytes that passed through the driver. The scaling model the figures are checked against
is in docs/memory.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = dict(model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
             tie_word_embeddings=False)


class Half:
    """An engine that declares only the odd layers."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def weight_metadata(self):
        return [m for m in self.inner.weight_metadata()
                if ".layers." in m.name and int(m.name.split(".layers.")[1].split(".")[0]) % 2 == 1]


@contextlib.asynccontextmanager
async def engines(n: int, tmp: Path):
    from miles_engine.engines.launch import ServerProcess

    (tmp / "config.json").write_text(json.dumps(MODEL))
    procs = []
    try:
        for i in range(n):
            argv = [sys.executable, "-m", "miles_engine.run.engine_server", "--model", str(tmp / "config.json"),
                    "--port", "0", "--port-file", str(tmp / f"port{i}"), "--threads", "1", "--dtype", "float32"]
            procs.append(ServerProcess(argv, port_file=tmp / f"port{i}", cwd=REPO, name=f"engine{i}",
                                       env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}))
        await asyncio.gather(*(p.start(180) for p in procs))
        yield procs
    finally:
        await asyncio.gather(*(p.stop(grace_s=10) for p in procs), return_exceptions=True)


async def _one_layout(sources: int, targets: int, half: bool, repeats: int, tmp: Path) -> dict:
    from miles_engine.engines.http.client import HttpEngine
    from miles_engine.trainer.distributed import FSDPTrainer
    from miles_engine.weights import create_transport
    from miles_engine.weights.p2p import P2PExport, TrainerSources

    out: dict = {"broadcast": [], "p2p": []}
    with FSDPTrainer(dict(MODEL), {"optimizer": {"lr": 1e-4}}, world_size=sources) as trainer:
        async with engines(targets, tmp) as procs:
            clients = [await HttpEngine(p.url, name=f"engine{i}").connect() for i, p in enumerate(procs)]
            declared = [Half(c) if half and i % 2 else c for i, c in enumerate(clients)]
            src = TrainerSources(trainer)
            p2p = create_transport("p2p", declared, sources=src, bucket_bytes=32 << 20, backend="gloo", timeout_s=120)
            bcast = create_transport("broadcast", clients, bucket_bytes=32 << 20, backend="gloo", timeout_s=120)
            version = 0
            for i in range(repeats + 1):  # the first of each builds its group: not counted
                for kind in (("p2p", "broadcast") if i % 2 == 0 else ("broadcast", "p2p")):
                    version += 1
                    t0 = time.perf_counter()
                    if kind == "p2p":
                        export = await P2PExport.stage(src, version)
                        stats = await p2p.push(export, version)
                        received = dict(p2p.target_bytes)
                    else:
                        named = await asyncio.to_thread(lambda: list(trainer.named_tensors()))
                        stats = await bcast.push(named, version)
                        received = {c.name: stats.bytes for c in clients}
                        stats.driver_bytes = stats.bytes
                    if i:
                        out[kind].append({"s": time.perf_counter() - t0, "received": received,
                                          "driver": stats.driver_bytes or 0})
            await p2p.close()
            await bcast.close()
            for c in clients:
                await c.aclose()
    return out


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", default="1x2,2x2,2x4,2x2half")
    args = p.parse_args()
    from tests.rollout.helpers import run

    n_params = sum(__import__("math").prod(s) for s in _shapes())
    print(f"Qwen3 {n_params / 1e6:.0f}M parameters, float32; {args.repeats} pushes of each, interleaved\n")
    print("| sources x targets | transport | s per update | MiB each engine received | MiB through the driver |")
    print("|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        half = layout.endswith("half")
        s, t = (int(x) for x in layout.removesuffix("half").split("x"))
        with tempfile.TemporaryDirectory(prefix="p2p-bench-") as tmp:
            res = run(_one_layout(s, t, half, args.repeats, Path(tmp)), 3600)
        for kind in ("broadcast", "p2p"):
            rows = res[kind]
            got = sorted({round(v / 2**20, 1) for v in rows[-1]["received"].values()})
            print(f"| {s} x {t}{' (half)' if half else ''} | {kind} | {_fmt([r['s'] for r in rows])} | "
                  f"{' / '.join(str(g) for g in got)} | {rows[-1]['driver'] / 2**20:.1f} |")


def _shapes() -> list[tuple[int, ...]]:
    h, i, v, n = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"], MODEL["num_hidden_layers"]
    q, kv = MODEL["num_attention_heads"] * MODEL["head_dim"], MODEL["num_key_value_heads"] * MODEL["head_dim"]
    per_layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    return [(v, h), (v, h)] + per_layer * n


if __name__ == "__main__":
    main()
