"""Megatron backend checkpoint save/load: ``checkpoint_format: hf`` vs ``dist`` (prints a table; not a test).

    .venv/bin/python bench/megatron_checkpoint_bench.py [--reps 5] [--tp 2] [--hidden 512] [--layers 4]

One trainer of a random Qwen3 (vocab 8192, the given hidden size and layers) over ``--tp`` ranks
(gloo on CPU), after one SFT step (so Adam's moments exist). Interleaved per rep:

- ``hf save``: ``state_dict()`` (gathered on rank 0, HF names, through the pipe to the driver) +
  ``torch.save`` of it to a file (what ``checkpoint.save`` writes as ``trainer.pt``)
- ``dist save``: ``save_shards(dir)`` (every rank writes its own shards) + ``torch.save`` of the rest
- ``hf load`` / ``dist load``: ``load_state_dict`` of each (read from the file; dist: from its shards)

Wall times seen by the driver: median and range over the reps; sizes on disk.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    import torch

    from miles_engine.trainer.factory import create_trainer

    torch.set_num_threads(1)
    model = dict(model_type="qwen3", vocab_size=8192, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=args.hidden // 8, max_position_embeddings=512, tie_word_embeddings=False,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = {"backend": "megatron", "megatron": {"tensor_parallel": args.tp}}
    root = Path(tempfile.mkdtemp(prefix="miles-ckpt-bench-"))
    times: dict[str, list[float]] = {k: [] for k in ("hf save", "dist save", "hf load", "dist load")}
    sizes: dict[str, int] = {}
    try:
        with create_trainer(model, cfg, world_size=args.tp) as tr:
            tr.sft_step([(list(range(1, 65)), [0] * 8 + [1] * 56)])
            for rep in range(args.reps):
                t0 = time.perf_counter()
                state = tr.state_dict()
                buf = io.BytesIO()
                torch.save(state, buf)
                (root / "trainer.pt").write_bytes(buf.getvalue())
                times["hf save"].append(time.perf_counter() - t0)
                sizes["hf"] = buf.tell()
                shards = root / f"dist{rep}"
                t0 = time.perf_counter()
                rest = tr.save_shards(shards)
                buf = io.BytesIO()
                torch.save(rest, buf)
                (root / "rest.pt").write_bytes(buf.getvalue())
                times["dist save"].append(time.perf_counter() - t0)
                sizes["dist"] = buf.tell() + sum(f.stat().st_size for f in shards.rglob("*") if f.is_file())
                t0 = time.perf_counter()
                tr.load_state_dict(torch.load(root / "trainer.pt", weights_only=False))
                times["hf load"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                tr.load_state_dict({**torch.load(root / "rest.pt", weights_only=False),
                                    "dist_checkpoint_path": str(shards)})
                times["dist load"].append(time.perf_counter() - t0)
                shutil.rmtree(shards)
        params = sum(v.numel() for k, v in state["model"].items())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nqwen3 hidden {args.hidden}, {args.layers} layers, vocab 8192: {params / 1e6:.1f} M params, "
          f"TP={args.tp}, {args.reps} reps (interleaved)")
    print(f"| {'what':<10} | {'median s':>9} | {'range s':>15} | {'on disk MB':>10} |")
    print(f"|{'-' * 12}|{'-' * 11}|{'-' * 17}|{'-' * 12}|")
    for k, v in times.items():
        size = sizes[k.split()[0]] / 1e6
        print(f"| {k:<10} | {statistics.median(v):>9.3f} | {min(v):>6.3f}-{max(v):<8.3f} | {size:>10.1f} |")


if __name__ == "__main__":
    main()
