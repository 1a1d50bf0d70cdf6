"""A byte-level BPE for a tiny policy, trained at start-up on the environment's own text and cached.

The corpus is the chat-rendered text of demonstrations (system prompt with the tool schema,
instructions, tool calls, tool outputs, answers), so the tokenizer compresses exactly what the
policy reads and writes. The chat family's special tokens are added tokens. The result is
cached under ``$MILES_CACHE_DIR/tokenizers/<hash>.json`` keyed by family, size and corpus.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pydantic import Field

from miles_engine.components import Section
from miles_engine.models.bpe import BPE_ADDED_TOKENS, train_bpe
from miles_engine.models.cache import cache_root, cached_tokenizer
from miles_engine.models.tokenizer import TitoTokenizer, load_tokenizer


class TokenizerConfig(Section):
    path: str | None = Field(None, description="an existing tokenizer (file, model dir, builtin:...); else train one")
    vocab_size: int = Field(2048, ge=300, le=200_000)
    corpus_demos: int = Field(3000, ge=100, description="demonstrations rendered into the training corpus")
    cache: bool = True


def policy_tokenizer(family_name: str, texts: Sequence[str], cfg: TokenizerConfig) -> TitoTokenizer:
    """Load ``cfg.path`` or train (and cache) a BPE on ``texts`` with ``family_name``'s added tokens."""
    if cfg.path:
        return load_tokenizer(cfg.path)
    added = BPE_ADDED_TOKENS.get(family_name, BPE_ADDED_TOKENS["chatml"])
    digest = hashlib.sha256()
    digest.update(f"v2|{family_name}|{cfg.vocab_size}|{added}".encode())
    for text in texts:
        digest.update(text.encode())
    cached = cache_root() / "tokenizers" / f"{family_name}-{cfg.vocab_size}-{digest.hexdigest()[:16]}.json"
    tok = cached_tokenizer(cached, lambda: train_bpe(texts, vocab_size=cfg.vocab_size, added=added), enabled=cfg.cache)
    return TitoTokenizer(tok, name=str(cached))
