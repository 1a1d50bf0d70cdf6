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
    """The policy codec of a recipe (the stack's: a BPE trained on the environment's demonstrations
    unless ``tokenizer.path`` is set)."""
    from miles_engine.tito import make_codec
    from miles_engine.tito.messages import normalize_messages, normalize_tools
    from miles_engine.train.policy_tokenizer import policy_tokenizer
    from miles_engine.train.stack import bootstrap_codec, demonstrations

    texts: list[str] = []
    if not cfg.tokenizer.path:
        boot = bootstrap_codec(hub, cfg)
        for d in demonstrations(source, cfg.tokenizer.corpus_demos, seed=cfg.seed + 17):
            texts.append(boot.render(normalize_messages(d.conversation()), normalize_tools(d.tools),
                                     add_generation_prompt=False))
    tokenizer = policy_tokenizer(cfg.chat_family.name, texts, cfg.tokenizer)
    return make_codec(cfg.chat_family.name, tokenizer, options=cfg.chat_family.options, hub=hub)


def build_model(cfg: Any, codec: Any) -> Any:
    from miles_engine.train.tiny_model import build_config, build_model as build

    if cfg.model.path:
        return cfg.model.path
    tok = codec.tokenizer
    config = build_config(cfg.model, tok.vocab_size, bos_id=None, eos_id=codec.stop_ids[0],
                          pad_id=tok.added_tokens.get("<|endoftext|>", 0))
    return build(config, cfg.seed)


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

        e = cfg.engine
        source = model if isinstance(model, str) else copy.deepcopy(model)
        engine = await asyncio.to_thread(EmbeddedEngine.from_model, source, dtype=e.dtype,
                                         max_batch_size=e.max_batch_size, num_threads=e.threads, seed=cfg.seed,
                                         prompt_cache_tokens=e.prompt_cache_tokens)
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
