"""Refuse a teacher whose tokenizer maps ids differently from the student's.

Distillation compares log-probs of the *same ids*; a teacher with a different id mapping
would silently score other tokens. At start-up the teacher's vocabulary size, the ids of the
student's added/special tokens and the ids of a probe string must all equal the student's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.models.tokenizer import load_tokenizer

PROBE_TEXT = ("The quick brown fox jumps over 13 lazy dogs; echo $((42 * 7)) > out.txt && cat out.txt\n"
              "{\"name\": \"run\", \"arguments\": {\"cmd\": \"ls -la /tmp\"}} Ünïcødé ✓ 数字")


@dataclass(frozen=True)
class VocabFingerprint:
    vocab_size: int
    special_ids: Mapping[str, int | None]  # token text -> id (None: not a single token)
    probe_ids: tuple[int, ...]


def fingerprint_tokenizer(tok: Any, probe: str, special_tokens: Sequence[str]) -> VocabFingerprint:
    """Fingerprint a :class:`~miles_engine.models.tokenizer.TitoTokenizer` (or anything it loads from)."""
    t = load_tokenizer(tok)
    return VocabFingerprint(t.vocab_size, {s: t.token_id(s) for s in special_tokens}, tuple(t.encode(probe)))


def check_compatible(student: VocabFingerprint, teacher: VocabFingerprint, *, teacher_name: str) -> None:
    """Raise :class:`ConfigError` naming the first difference between the two id mappings."""
    where = f"teacher '{teacher_name}'"
    if student.vocab_size != teacher.vocab_size:
        raise ConfigError(f"{where}: tokenizer has {teacher.vocab_size} ids, the student's has {student.vocab_size}; "
                          f"a teacher must use the student's tokenizer (same ids)")
    for text, sid in student.special_ids.items():
        tid = teacher.special_ids.get(text)
        if tid != sid:
            raise ConfigError(f"{where}: special token {text!r} is id {tid} for the teacher but {sid} for the student")
    if tuple(student.probe_ids) != tuple(teacher.probe_ids):
        first = next((i for i, (a, b) in enumerate(zip(student.probe_ids, teacher.probe_ids)) if a != b),
                     min(len(student.probe_ids), len(teacher.probe_ids)))
        raise ConfigError(f"{where}: the probe string tokenizes differently from token {first} on "
                          f"(student {list(student.probe_ids[first:first + 5])}, teacher "
                          f"{list(teacher.probe_ids[first:first + 5])}); a teacher must use the student's tokenizer")
