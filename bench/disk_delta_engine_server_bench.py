"""disk_delta with the engine pulling for itself (``apply_on=engine``): our engine server in its
own process syncs from the publish root, persisting its local copy. For each encoding and
fraction of changed bytes (``rows`` pattern of ``disk_delta_bench``), one push; prints what
the engine reports (pull, apply = decompress + patch + verify while generating, pause = the
load only, persist = writing its local copy after resuming, the whole sync) against a full
reload of the same model through ``/update_weights_from_disk`` (SGLang's way: the whole
checkpoint read and loaded).

    .venv/bin/python bench/disk_delta_engine_server_bench.py [--hidden 512 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.disk_delta_bench import change, config
from miles_engine.models.loading import load_model
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.launch import ServerProcess
from miles_engine.weights import create_transport


async def one(tmp: Path, cfg: dict[str, Any], encoding: str, fractions: list[float]) -> list[dict[str, Any]]:
    from safetensors.torch import save_file

    model, _ = load_model(dict(cfg), seed=0)
    model = model.to(torch.bfloat16)
    named = {n: t.detach().clone() for n, t in model.state_dict().items()}
    baseline = tmp / "baseline.safetensors"
    save_file(named, str(baseline))
    (tmp / "config.json").write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "miles_engine.run.engine_server", "--model", str(tmp / "config.json"),
            "--port", "0", "--port-file", str(tmp / "port"), "--threads", "2", "--dtype", "bfloat16"]
    server = ServerProcess(argv, port_file=tmp / "port", cwd=ROOT, name="engine", log_path=tmp / "server.log",
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    await server.start(300)
    engine = await HttpEngine(server.url, name="bench-engine").connect()
    rows = []
    try:
        transport = create_transport("disk_delta", engine, root=str(tmp / "publish"), baseline=str(baseline),
                                     encoding=encoding, engine_local_dir=str(tmp / "local" / "{engine}"))
        await transport.push(model.named_parameters(), version=0)
        gen = torch.Generator().manual_seed(1)
        for version, fraction in enumerate(fractions, start=1):
            change(model, fraction, "rows", gen)
            stats = await transport.push(model.named_parameters(), version=version)
            sync = transport.appliers[id(engine)]
            rows.append({"encoding": encoding, "fraction": fraction, "wire_mb": stats.bytes / 1e6,
                         "pull_s": stats.pull_s, "apply_s": stats.apply_s, "pause_s": stats.pause_s,
                         "persist_s": stats.persist_s, "push_s": stats.push_s, "held": sync.held})
        full = tmp / "full"
        full.mkdir()
        save_file({n: t.detach().clone() for n, t in model.state_dict().items()}, str(full / "model.safetensors"))
        t0 = time.perf_counter()
        await engine.update_weights(full, version=len(fractions) + 1)
        reload_s = time.perf_counter() - t0
        for r in rows:
            r["full_reload_s"] = reload_s
        await transport.close()
    finally:
        await engine.aclose()
        await server.stop(grace_s=10)
    return rows


async def main(args: argparse.Namespace) -> None:
    cfg = config(args.hidden, args.layers, args.vocab)
    rows = []
    for encoding in ("xor", "overwrite"):
        with tempfile.TemporaryDirectory(prefix="dd-engine-bench-") as tmp:
            rows += await one(Path(tmp), cfg, encoding, args.fractions)
    model, _ = load_model(dict(cfg), seed=0)
    mb = sum(p.numel() for p in model.state_dict().values()) * 2 / 1e6
    print(f"model: {mb:.1f} MB bf16 (hidden {args.hidden}, layers {args.layers}, vocab {args.vocab})")
    print(f"{'enc':9} {'changed':>7} {'wire MB':>8} {'pull s':>7} {'apply s':>8} {'pause s':>8} {'persist s':>9} "
          f"{'push s':>7} {'full reload s':>13}")
    for r in rows:
        print(f"{r['encoding']:9} {r['fraction']:7.1%} {r['wire_mb']:8.2f} {r['pull_s']:7.3f} {r['apply_s']:8.3f} "
              f"{r['pause_s']:8.3f} {r['persist_s']:9.3f} {r['push_s']:7.3f} {r['full_reload_s']:13.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.005, 0.02, 0.10])
    asyncio.run(main(ap.parse_args()))
