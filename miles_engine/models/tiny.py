"""Tiny causal LMs built from a config (no downloads): the CPU recipe's policy."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section


class TinyModelConfig(Section):
    """A Qwen3-architecture model from scratch; ``vocab_size`` comes from the tokenizer."""

    path: str | None = Field(None, description="load this model instead (dir, .gguf, config.json)")
    arch: Literal["qwen3", "qwen3_moe"] = "qwen3"
    hidden_size: int = Field(128, ge=16)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int = Field(32, ge=8)
    intermediate_size: int = Field(384, ge=16)
    max_position_embeddings: int = Field(1024, ge=64)
    tie_word_embeddings: bool = True
    num_experts: int = Field(8, ge=2, description="qwen3_moe only")
    num_experts_per_tok: int = Field(2, ge=1, description="qwen3_moe only")
    moe_intermediate_size: int = Field(128, ge=8, description="qwen3_moe only")


def build_config(cfg: TinyModelConfig, vocab_size: int, *, bos_id: int | None, eos_id: int | None,
                 pad_id: int | None) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    if cfg.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                              moe_intermediate_size=cfg.moe_intermediate_size)
    return Qwen3Config(**common)


def build_model(config: Any, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.float()
