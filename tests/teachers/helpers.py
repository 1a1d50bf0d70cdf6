"""A tiny teacher model directory with its own BPE tokenizer, built on the fly (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = ["echo hello world > greeting.txt", "the answer is 42\n", "ls -la /tmp && cat notes.md",
          "<|im_start|>user\nwhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n51<|im_end|>"] * 30


def tiny_tokenizer(vocab_size: int = 320):
    from miles_engine.models.tokenizer import TitoTokenizer
    from miles_engine.models.bpe import BPE_ADDED_TOKENS
    from miles_engine.models.bpe import train_bpe

    return TitoTokenizer(train_bpe(CORPUS, vocab_size=vocab_size, added=BPE_ADDED_TOKENS["chatml"]), name="tiny")


def make_model_dir(root: Path, *, hidden: int = 64, seed: int = 0, tokenizer=None) -> Path:
    """A saved Qwen3 (random init) plus ``tokenizer.json``; returns the directory."""
    from miles_engine.models.tiny import TinyModelConfig, build_config, build_model

    tok = tokenizer or tiny_tokenizer()
    cfg = build_config(TinyModelConfig(hidden_size=hidden, num_hidden_layers=1, intermediate_size=2 * hidden,
                                       head_dim=16, max_position_embeddings=256),
                       tok.vocab_size, bos_id=None, eos_id=None, pad_id=None)
    model = build_model(cfg, seed)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(root))
    tok.backend.save(str(root / "tokenizer.json"))
    return root
