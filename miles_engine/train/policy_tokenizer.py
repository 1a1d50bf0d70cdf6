"""A byte-level BPE for a tiny policy, trained at start-up on the environment's own text and cached.

The corpus is the chat-rendered text of demonstrations (system prompt with the tool schema,
instructions, tool calls, tool outputs, answers), so the tokenizer compresses exactly what the
policy reads and writes. The chat family's special tokens are added tokens. The result is
cached under ``$MILES_CACHE_DIR/tokenizers/<hash>.json`` keyed by family, size and corpus.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from miles_engine.components import Section
from miles_engine.tito.tokenizer import TitoTokenizer


class TokenizerConfig(Section):
    path: str | None = Field(None, description="an existing tokenizer (file, model dir, builtin:...); else train one")
    vocab_size: int = Field(2048, ge=300, le=200_000)
    corpus_demos: int = Field(3000, ge=100, description="demonstrations rendered into the training corpus")
    cache: bool = True


def cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE_DIR") or Path.home() / ".cache" / "miles-engine") / "tokenizers"


def train_bpe(texts: Sequence[str], *, vocab_size: int, added: Sequence[tuple[str, bool]]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    # No word-level pre-split: merges may span spaces, so the fixed scaffolding (system prompt,
    # tool schema, tool-call JSON) collapses into a few long tokens and rows stay short. Digits
    # stay single tokens so numbers are copied digit by digit.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, normalized=False, special=True) for t, special in added if special],
        show_progress=False,
        max_token_length=64,
    )
    # The trainer does not split its corpus at added tokens: without this, merges swallow
    # "<|im_end|>\n<|im_start|>" as plain bytes and the policy can sample fake special tokens.
    split = re.compile("|".join(re.escape(t) for t, _ in sorted(added, key=lambda a: -len(a[0]))))
    tok.train_from_iterator((seg for text in texts for seg in split.split(text) if seg), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, special in added if not special])
    return tok


def policy_tokenizer(family_name: str, texts: Sequence[str], cfg: TokenizerConfig) -> TitoTokenizer:
    """Load ``cfg.path`` or train (and cache) a BPE on ``texts`` with ``family_name``'s added tokens."""
    from tokenizers import Tokenizer

    from miles_engine.tito.tokenizer import load_tokenizer
    from miles_engine.tito.vocab import BPE_ADDED_TOKENS

    if cfg.path:
        return load_tokenizer(cfg.path)
    added = BPE_ADDED_TOKENS.get(family_name, BPE_ADDED_TOKENS["chatml"])
    digest = hashlib.sha256()
    digest.update(f"v2|{family_name}|{cfg.vocab_size}|{added}".encode())
    for text in texts:
        digest.update(text.encode())
    cached = cache_dir() / f"{family_name}-{cfg.vocab_size}-{digest.hexdigest()[:16]}.json"
    if cfg.cache and cached.is_file():
        try:
            return TitoTokenizer(Tokenizer.from_file(str(cached)), name=str(cached))
        except Exception:  # a corrupt cache entry is rebuilt
            pass
    tok = train_bpe(texts, vocab_size=cfg.vocab_size, added=added)
    if cfg.cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            tok.save(str(tmp))
            os.replace(tmp, cached)
        except OSError:
            pass
    return TitoTokenizer(tok, name=str(cached))
