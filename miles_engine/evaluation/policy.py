"""A policy to evaluate, served: an embedded engine behind its own TITO session server.

Used by the ``dedicated`` eval mode (built from the training model, then fed weight snapshots)
and by ``miles eval --checkpoint`` (built from a recipe, then loaded with a checkpoint's
weights). The codec and model are built exactly as the training stack builds them, so a
checkpoint's token ids mean what they meant in training (checked against its tokenizer digest).
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

POLICY_PREFIX = "policy."  # the trainer's state dict holds the policy under this module name


def build_codec(hub: Any, cfg: Any, source: Any) -> Any:
    """The policy codec of a recipe, built as the composition root builds it."""
    from miles_engine.train.model_build import build_codec as build

    return build(cfg, hub, source)


def build_model(cfg: Any, codec: Any) -> Any:
    from miles_engine.train.model_build import build_policy

    return build_policy(cfg, codec)


@dataclass
class ServedPolicy:
    """An engine and the session server in front of it; :meth:`aclose` stops both."""

    engine: Any
    server: Any
    _closed: bool = field(default=False, repr=False)

    @classmethod
    async def start(cls, model: Any, codec: Any, cfg: Any) -> ServedPolicy:
        from miles_engine.engines.embedded import EmbeddedEngine
        from miles_engine.tito.serve import start_session_server

        from miles_engine.engines.fleet.config import EmbeddedKindOptions

        group = cfg.engines[0]  # the first group's dtype and device; its options if it is embedded
        e = EmbeddedKindOptions(**group.options) if group.kind == "embedded" else EmbeddedKindOptions()
        source = model if isinstance(model, str) else copy.deepcopy(model)
        engine = await asyncio.to_thread(EmbeddedEngine.from_model, source, dtype=group.dtype,
                                         device=group.replica_device(0), max_batch_size=e.max_batch_size,
                                         num_threads=e.threads, seed=cfg.seed,
                                         prompt_cache_tokens=e.prompt_cache_tokens,
                                         true_on_policy=cfg.trainer.true_on_policy)
        try:
            server = await start_session_server(engine, codec, config=cfg.session_server)
        except BaseException:
            await engine.aclose()
            raise
        return cls(engine, server)

    @property
    def url(self) -> str:
        return str(self.server.url)

    async def load(self, tensors: dict[str, Any], version: int) -> None:
        await self.engine.update_weights(tensors, version=version)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.server.stop()
        finally:
            await self.engine.aclose()


@dataclass
class CheckpointWeights:
    path: Path
    step: int
    weight_version: int
    tensors: dict[str, Any]
    tokenizer_sha256: str | None


def read_checkpoint_weights(path: Path) -> CheckpointWeights:
    """The policy tensors of a checkpoint directory (``RUN_DIR/checkpoints/step_NNNNNNNN``)."""
    import torch

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"--checkpoint {path}: no manifest.json there; pass a checkpoint directory "
                          f"(RUN_DIR/checkpoints/step_NNNNNNNN)")
    manifest = json.loads(manifest_path.read_text())
    state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    model = state.get("model") or {}
    tensors = {k[len(POLICY_PREFIX):]: v for k, v in model.items() if k.startswith(POLICY_PREFIX)}
    if not tensors:
        raise ConfigError(f"--checkpoint {path}: trainer.pt holds no '{POLICY_PREFIX}*' policy tensors")
    return CheckpointWeights(path, int(manifest["step"]), int(manifest["weight_version"]), tensors,
                             manifest.get("tokenizer_sha256"))
