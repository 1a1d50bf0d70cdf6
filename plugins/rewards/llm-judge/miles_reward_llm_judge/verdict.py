"""The judge's verdict, read robustly from free text; anything unreadable is a :class:`VerdictError`.

Read in this order (the last occurrence wins within each rule; ``<think>...</think>`` is ignored):

1. a JSON object with a numeric ``score`` (or ``rating``) — ``{"score": 7}``;
2. ``SCORE: 7`` / ``Rating = 7/10`` / ``grade: 0.7`` (``/N`` overrides the configured scale);
3. ``VERDICT: CORRECT`` / ``INCORRECT`` / ``YES`` / ``NO`` / ``PASS`` / ``FAIL`` → 1 or 0.

The score is divided by the scale and must land in [0, 1]; a score outside the scale, a
non-finite number or no verdict at all is an error, never a guessed reward.
"""

from __future__ import annotations

import json
import math
import re

MAX_VERDICT_CHARS = 20_000
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_JSON = re.compile(r"\{[^{}]{0,500}\}")
_SCORE = re.compile(r"\b(?:score|rating|grade)\**\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?",
                    re.IGNORECASE)
_LABEL = re.compile(r"\bverdict\**\s*[:=]\s*\**\s*(correct|incorrect|yes|no|pass|fail)\b", re.IGNORECASE)
_LABEL_VALUE = {"correct": 1.0, "yes": 1.0, "pass": 1.0, "incorrect": 0.0, "no": 0.0, "fail": 0.0}


class VerdictError(ValueError):
    """The judge's answer holds no readable verdict."""


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= 160 else text[:80] + " … " + text[-60:])


def _scaled(value: float, scale: float, text: str) -> tuple[float, float]:
    if not math.isfinite(value) or not math.isfinite(scale) or scale <= 0:
        raise VerdictError(f"the judge's score {value}/{scale} is not a usable number: {_shown(text)}")
    if not 0.0 <= value <= scale:
        raise VerdictError(f"the judge's score {value:g} is outside 0..{scale:g}: {_shown(text)}")
    return value / scale, value


def parse_verdict(text: str, *, scale: float = 10.0) -> tuple[float, float]:
    """``(reward in [0, 1], raw score)`` from the judge's answer ``text``."""
    if not isinstance(text, str) or not text.strip():
        raise VerdictError("the judge returned an empty answer")
    body = _THINK.sub(" ", text[-MAX_VERDICT_CHARS:])
    for blob in reversed(_JSON.findall(body)):
        try:
            data = json.loads(blob)
        except ValueError:
            continue
        if isinstance(data, dict):
            for key in ("score", "rating"):
                value = data.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return _scaled(float(value), scale, text)
    scores = _SCORE.findall(body)
    if scores:
        value, out_of = scores[-1]
        return _scaled(float(value), float(out_of) if out_of else scale, text)
    labels = _LABEL.findall(body)
    if labels:
        reward = _LABEL_VALUE[labels[-1].lower()]
        return reward, reward
    raise VerdictError(f"no verdict ('SCORE: n', '{{\"score\": n}}' or 'VERDICT: CORRECT|INCORRECT') in the "
                       f"judge's answer: {_shown(text)}")
