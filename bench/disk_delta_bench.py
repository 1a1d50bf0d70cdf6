"""disk_delta weight transport figures on a ~100M-parameter Qwen3 (random init from a config,
bf16, no download). For 0.5 %, 2 % and 10 % of the model's bytes changed, two change
patterns (``rows``: whole random rows of every tensor, as when only some embedding rows or
channels move; ``scattered``: random single elements, the worst case for position coding;
``tensors``: some whole tensors move, the others not at all)
and both encodings, one push each into an in-process embedded engine. Prints:

- wire bytes (shards + index) against the changed bytes and against a full safetensors
  save (the target is wire <= 1.1 x changed + index);
- publish (trainer: diff + compress + checksums + fsync) and apply (engine: read +
  decompress + patch + verify) time as a multiple of one plain memory copy of the model's
  bytes (``x memcpy``), and their throughput over the model's bytes;
- the engine's pause (load of the changed tensors only) against a full reload of every
  tensor (in memory, and from the safetensors file).

    .venv/bin/python bench/disk_delta_bench.py [--hidden 768 --layers 12 --vocab 32000] [--root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from miles_engine.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from miles_engine.weights import create_transport  # noqa: E402
from miles_engine.weights.disk_delta.layout import version_dir  # noqa: E402


def config(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    heads = hidden // 64
    return dict(model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)


def change(model: torch.nn.Module, fraction: float, pattern: str, gen: torch.Generator) -> None:
    """Give ``fraction`` of every tensor's rows (``rows``) or elements (``scattered``) new values, or
    move whole tensors (``tensors``, largest first from a random order) until ``fraction`` of the bytes."""
    with torch.no_grad():
        if pattern == "tensors":
            params = list(model.parameters())
            budget = fraction * sum(p.numel() for p in params)
            for i in torch.randperm(len(params), generator=gen).tolist():
                p = params[i]
                if p.numel() <= budget:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
                    budget -= p.numel()
            return
        for p in model.parameters():
            flat = p.view(p.shape[0], -1) if pattern == "rows" and p.dim() > 1 else p.view(-1, 1)
            if pattern == "rows" and p.dim() == 1:  # a vector: one contiguous stretch
                n = max(1, int(p.numel() * fraction))
                start = int(torch.randint(0, p.numel() - n + 1, (1,), generator=gen))
                p.view(-1)[start:start + n] += 0.05 * torch.randn(n, generator=gen).to(p.dtype)
                continue
            n = max(1, int(flat.shape[0] * fraction))
            idx = torch.randperm(flat.shape[0], generator=gen)[:n]
            flat[idx] = (flat[idx].float() + 0.05 * torch.randn(flat[idx].shape, generator=gen)).to(p.dtype)


def memcpy_s(nbytes: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return best


async def full_reload_s(engine: EmbeddedEngine, named: dict[str, torch.Tensor], version: int,
                        path: Path | None = None) -> float:
    t = time.perf_counter()
    await engine.pause("retract")
    try:
        await engine.update_weights(path if path is not None else named, version=version)
    finally:
        await engine.resume()
    return time.perf_counter() - t


async def main(args: argparse.Namespace) -> None:
    cfg = config(args.hidden, args.layers, args.vocab)
    t = time.perf_counter()
    engine = EmbeddedEngine.from_model(cfg, dtype="bfloat16", num_threads=1, max_context=256)
    trainer = copy.deepcopy(engine.model)
    params = sum(p.numel() for p in trainer.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    print(f"model: qwen3 hidden={args.hidden} layers={args.layers} vocab={args.vocab}: {params / 1e6:.1f}M "
          f"parameters, {model_bytes / 1e6:.0f} MB bf16 (built in {time.perf_counter() - t:.1f}s)")
    copy_s = memcpy_s(model_bytes)
    print(f"memcpy of {model_bytes / 1e6:.0f} MB: {copy_s * 1e3:.1f} ms ({model_bytes / copy_s / 1e9:.2f} GB/s)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    version = 0
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        for encoding in ("overwrite", "xor"):
            root = Path(tmp) / encoding
            transport = create_transport("disk_delta", engine, root=str(root), encoding=encoding)
            t = time.perf_counter()
            await transport.preflight(trainer.named_parameters())  # writes the baseline: a full safetensors save
            save_s = time.perf_counter() - t
            full_bytes = sum(f.stat().st_size for f in version_dir(root, 0).glob("*.safetensors"))
            if encoding == "overwrite":
                print(f"full safetensors save (baseline, tied embedding stored twice): {full_bytes / 1e6:.0f} MB, "
                      f"{save_s:.2f}s incl. checksums; wire/full below is against {model_bytes / 1e6:.0f} MB")
            for pattern in ("rows", "scattered", "tensors"):
                for fraction in args.fractions:
                    change(trainer, fraction, pattern, gen)
                    version += 1
                    s = await transport.push(list(trainer.named_parameters()), version=version)
                    index_bytes = (version_dir(root, version) / "index.json").stat().st_size
                    rows.append(dict(enc=encoding, pattern=pattern, target=fraction, density=s.changed_density,
                                     changed=s.changed_bytes, wire=s.bytes, index=index_bytes,
                                     full=min(full_bytes, model_bytes),  # tied weights saved once
                                     publish=s.publish_s, apply=s.pull_s + s.apply_s, pause=s.pause_s))
            await transport.close()
            engine = await _fresh(engine, trainer)
        named = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
        reload_mem = min([await full_reload_s(engine, named, version + 1 + i) for i in range(3)])
        st = Path(tmp) / "full"
        st.mkdir()
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in named.items() if n != "lm_head.weight"}, str(st / "m.safetensors"))
        reload_disk = min([await full_reload_s(engine, named, version + 4 + i, st) for i in range(2)])
    await engine.aclose()
    _print(rows, model_bytes, copy_s, reload_mem, reload_disk)


async def _fresh(engine: EmbeddedEngine, trainer: torch.nn.Module) -> EmbeddedEngine:
    """A new engine at version 0 holding the trainer's current weights (the next encoding's baseline)."""
    await engine.aclose()
    return EmbeddedEngine.from_model(trainer, dtype="bfloat16", num_threads=1, max_context=256)


def _print(rows: list[dict[str, Any]], model_bytes: int, copy_s: float, reload_mem: float, reload_disk: float) -> None:
    head = (f"{'enc':9} {'pattern':9} {'target':>6} {'changed':>8} {'changedMB':>9} {'wireMB':>8} {'wire/chg':>8} "
            f"{'wire/full':>9} {'<=1.1x+idx':>10} {'publish_s':>9} {'x memcpy':>8} {'pubGB/s':>7} {'apply_s':>7} "
            f"{'x memcpy':>8} {'appGB/s':>7} {'pause_ms':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ok = r["wire"] <= 1.1 * r["changed"] + r["index"]
        print(f"{r['enc']:9} {r['pattern']:9} {r['target']:6.1%} {r['density']:8.2%} {r['changed'] / 1e6:9.2f} "
              f"{r['wire'] / 1e6:8.2f} {r['wire'] / r['changed']:8.2f} {r['wire'] / r['full']:9.2%} "
              f"{'yes' if ok else 'no':>10} {r['publish']:9.2f} {r['publish'] / copy_s:8.1f} "
              f"{model_bytes / r['publish'] / 1e9:7.2f} {r['apply']:7.2f} {r['apply'] / copy_s:8.1f} "
              f"{model_bytes / r['apply'] / 1e9:7.2f} {r['pause'] * 1e3:8.1f}")
    print(f"full reload of every tensor (pause): {reload_mem * 1e3:.1f} ms from memory, {reload_disk * 1e3:.1f} ms "
          f"from a safetensors file")
    pauses = [r["pause"] for r in rows]
    print(f"disk_delta pause: {min(pauses) * 1e3:.1f}-{max(pauses) * 1e3:.1f} ms "
          f"({min(pauses) / reload_mem:.2f}-{max(pauses) / reload_mem:.2f} x the in-memory full reload)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.005, 0.02, 0.10])
    ap.add_argument("--root", default=None, help="directory for the publish roots (default: the system temp dir)")
    asyncio.run(main(ap.parse_args()))
