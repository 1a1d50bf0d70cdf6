"""Client ``stop`` strings over an engine that stops on token ids only.

A stop string that is one added token is passed to the engine as a stop id. Any other stop
string is applied after generation: the output is cut after the first token that completes
the string (those ids stay in the row verbatim: they were sampled) and the response text ends
before the string, as OpenAI's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_engine.tito.families.base import ChatCodec


@dataclass
class Cut:
    keep: int  # how many output ids stay in the row
    text: str | None  # the response text when a stop string cut it, else None (parse the ids)
    stop: str | None = None  # the stop string that cut it


def apply_stop_strings(codec: ChatCodec, output_ids: Sequence[int], stops: Sequence[str]) -> Cut:
    n = len(output_ids)
    if not stops or not n:
        return Cut(n, None)
    tok = codec.tokenizer
    if output_ids[-1] not in codec.stop_ids and tok.piece(output_ids[-1]) in stops \
            and output_ids[-1] in tok.added_ids:
        return Cut(n, tok.decode(output_ids[:-1]), tok.piece(output_ids[-1]))
    ids = codec.strip_stop(output_ids)
    text = tok.decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return Cut(n, None)
    at, stop = min(hits)
    need = at + len(stop)
    lo, hi = 1, len(ids)  # smallest k with decode(ids[:k]) covering the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[:mid])) >= need and stop in tok.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return Cut(lo, text[:at], stop)
