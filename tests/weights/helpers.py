"""A tiny Qwen3 config, a "trainer" model with other weights than the engine's, and digests."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
TINY_QWEN3 = dict(model_type="qwen3", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def trainer_model(seed: int = 1, config: dict[str, Any] | None = None) -> Any:
    """A model of the same architecture with different (seeded) random weights."""
    from miles_engine.models.loading import load_model

    import torch

    model, _ = load_model(dict(config or TINY_QWEN3), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # as if trained a little: norms are no longer all ones, so every tensor differs
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return model


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))


@contextlib.contextmanager
def engine_process(tmp: Path, *extra: str, start_s: float = 120) -> Iterator[Any]:
    """Our engine server (``miles_engine.run.engine_server``) on TINY_QWEN3 in float32, one thread,
    as another process; ``extra``: more of its flags. Stopped on exit."""
    from miles_engine.engines.launch import ServerProcess
    from tests.rollout.helpers import run

    (tmp / "config.json").write_text(json.dumps(TINY_QWEN3))
    argv = [sys.executable, "-m", "miles_engine.run.engine_server", "--model", str(tmp / "config.json"),
            "--port", "0", "--port-file", str(tmp / "port"), "--threads", "1", "--dtype", "float32", *extra]
    proc = ServerProcess(argv, port_file=tmp / "port", cwd=REPO, name="engine",
                         env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    run(proc.start(start_s), start_s + 10)
    try:
        yield proc
    finally:
        run(proc.stop(grace_s=10), 30)
