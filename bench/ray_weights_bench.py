"""Broadcast weights under ``placement.backend=ray``: the driver as rank 0 (trainer rank 0's
export crosses Ray to the driver, which broadcasts it) vs trainer rank 0's actor as rank 0 (only
bucket specs cross). Prints a table; not a test.

    .venv/bin/python bench/ray_weights_bench.py [--rounds 6] [--hidden 256] [--layers 4]

A private loopback cluster (2 CPUs), 2 ``server`` engine actors and 1 trainer rank actor, built
by the composition root's own builders from tiny-terminal; a Qwen3 policy of ``--hidden`` /
``--layers`` (float32). Per push: the export (gathered on rank 0; for the driver sender also
shipped here) + the broadcast push with its version check. The two senders alternate, in
swapped order every round, each on its own group (built by a first push that is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from miles_engine.config import load_recipe  # noqa: E402
from miles_engine.hub import default_hub  # noqa: E402
from miles_engine.run.compose import Teardown, _engine_kinds, _start_engines, _start_placement  # noqa: E402
from miles_engine.run.trainer_access import TrainerAccess  # noqa: E402
from miles_engine.weights import create_transport  # noqa: E402


def policy(hidden: int, layers: int) -> object:
    from miles_engine.models.loading import load_model

    config = dict(model_type="qwen3", vocab_size=2048, hidden_size=hidden, intermediate_size=3 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    return load_model(config, seed=0)[0]


async def bench(args: argparse.Namespace, run_dir: Path, temp: Path) -> dict[str, dict[str, list[float]]]:
    cfg = load_recipe("tiny-terminal", [
        "engines=[{kind: server, replicas: 2}]", "weights.transport=broadcast", "placement.backend=ray",
        "placement.ray.num_cpus=2", "placement.ray.engine_resources={CPU: 0.5}",
        "placement.ray.trainer_resources={CPU: 0.5}", "placement.ray.runner_resources={CPU: 0.25}",
        f"placement.ray.temp_dir={temp}"], hub=default_hub())
    model = policy(args.hidden, args.layers)
    out: dict[str, dict[str, list[float]]] = {k: {"push_s": [], "driver_mb": []} for k in ("driver", "rank0")}
    async with Teardown() as stack:
        kinds = _engine_kinds(cfg, default_hub())
        placement = await _start_placement(cfg, kinds, run_dir, stack)
        trainer = await asyncio.to_thread(TrainerAccess.create, model, cfg, ranks=placement.trainer_ranks())
        stack.push_async_callback(asyncio.to_thread, trainer.close)
        engines = await _start_engines(cfg, kinds, run_dir, model, trainer, placement, stack)
        driver = create_transport("broadcast", engines, master_address=placement.driver_address(),
                                  group_name="bench-driver")
        stack.push_async_callback(driver.close)
        rank0 = create_transport("broadcast", engines, sender=trainer.use_rank0_sender(), group_name="bench-rank0")
        stack.push_async_callback(rank0.close)
        version = 0

        async def push(name: str) -> tuple[float, float]:
            nonlocal version
            version += 1
            t0 = time.perf_counter()
            if name == "driver":
                stats = await driver.push(await trainer.named_tensors(), version)
            else:
                stats = await rank0.push(await trainer.export_for_push(), version)
            return time.perf_counter() - t0, stats.driver_bytes / 1e6

        for name in out:  # builds each group
            await push(name)
        for r in range(args.rounds):
            for name in (["driver", "rank0"] if r % 2 == 0 else ["rank0", "driver"]):
                s, mb = await push(name)
                out[name]["push_s"].append(s)
                out[name]["driver_mb"].append(mb)
        model_mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
        print(f"\npolicy: Qwen3 hidden {args.hidden}, {args.layers} layers, {model_mb:.1f} MB float32; "
              f"2 server engine actors, 1 trainer rank actor; {args.rounds} interleaved rounds")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    temp = Path(tempfile.mkdtemp(prefix="mwb-", dir="/tmp"))
    run_dir = Path(tempfile.mkdtemp(prefix="miles-weights-bench-"))
    try:
        results = asyncio.run(bench(args, run_dir, temp))
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"{'rank 0 of the group':>22}{'push s (median)':>17}{'range':>16}{'MB via driver':>15}")
    for name, r in results.items():
        s, mb = r["push_s"], r["driver_mb"]
        label = "the driver" if name == "driver" else "trainer rank 0"
        print(f"{label:>22}{statistics.median(s):>17.3f}{f'{min(s):.3f}-{max(s):.3f}':>16}"
              f"{statistics.median(mb):>15.1f}")


if __name__ == "__main__":
    main()
