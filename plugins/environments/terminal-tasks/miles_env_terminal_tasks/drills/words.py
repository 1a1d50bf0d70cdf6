"""The default word pool: invented, lower-case, shell-safe words (like the prototype's 200)."""

from __future__ import annotations

import random
import re
from functools import lru_cache

WORD_RE = re.compile(r"^[a-z]{2,16}$")
_ONSETS = "b d f g h k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()
_CODAS = ["", "", "", "n", "r", "s", "l"]
_POOL_SEED = 20240521


@lru_cache(maxsize=16)
def default_words(size: int) -> tuple[str, ...]:
    """``size`` distinct invented words (2-3 syllables, e.g. ``kalomi``), the same on every run."""
    rng = random.Random(_POOL_SEED)
    seen: dict[str, None] = {}
    while len(seen) < size:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        word += rng.choice(_CODAS)
        seen.setdefault(word, None)
    return tuple(seen)
