"""Bytes the disk_delta transport publishes into an engine holding each rollout format (the
quantizer's codes + scales, quantised once on the trainer's side) against a full-precision
(float32) engine: the baseline and two versions of small updates. Byte counts, not timings.

    PYTHONPATH=. .venv/bin/python bench/disk_delta_formats.py
"""

from __future__ import annotations

import asyncio
import copy
import tempfile

import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.models.loading import load_model
from miles_engine.weights import create_transport

CONFIG = dict(model_type="qwen3", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
              tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)


async def measure(fmt: str) -> tuple[int, list[int]]:
    trainer, _ = load_model(dict(CONFIG), seed=3)
    engine = EmbeddedEngine.from_model(copy.deepcopy(trainer), weight_format=fmt, num_threads=1, max_context=64)
    with tempfile.TemporaryDirectory() as root:
        transport = create_transport("disk_delta", engine, root=root)
        await transport.push(trainer.named_parameters(), version=0)
        versions = []
        for v in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(v)))
            versions.append((await transport.push(trainer.named_parameters(), version=v)).bytes)
        baseline = transport.baseline.total_bytes
        await transport.close()
        await engine.aclose()
    return baseline, versions


def main() -> None:
    torch.set_num_threads(1)
    rows = {fmt: asyncio.run(measure(fmt)) for fmt in ("full", "fp8", "mxfp8", "nvfp4", "int4")}
    full_base, full_versions = rows["full"]
    print(f"{'format':7} {'baseline MB':>12} {'(vs full)':>9} {'version MB':>11} {'(vs full)':>9}")
    for fmt, (base, versions) in rows.items():
        v = sum(versions) / len(versions)
        print(f"{fmt:7} {base / 1e6:12.2f} {base / full_base:9.2f} {v / 1e6:11.2f} "
              f"{v / (sum(full_versions) / len(full_versions)):9.2f}")


if __name__ == "__main__":
    main()
