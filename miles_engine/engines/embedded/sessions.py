"""Per-session prefix cache: an LRU of the KV a session's last request left behind.

An entry holds the session's token row (prompt + output) and the K/V (and, for MoE, the
routed experts) of every token that went through the model — all but the last output token.
A new request of that session reuses the longest common prefix of its ``input_ids`` and the
entry's row (at most ``len(input_ids) - 1`` tokens, so at least one token is prefilled and
produces the first logits), and prefills only the rest. Causal attention makes any prefix of
a KV row exactly the KV of that prefix, so a partial match is still exact; no match is a
plain full prefill. Entries computed under an older weight version are never reused (the
store is cleared on every weight update). Bounded by a token budget, least recently used
first out.

The same store, keyed by a whole prompt, is the shared-prompt cache: the attempts of a GRPO
group send one prompt, so the first one's prefill serves the others (they prefill only their
last token). Only whole-prompt matches are shared (no radix tree over partial prefixes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass
class SessionEntry:
    tokens: list[int]  # prompt + output
    keys: list[torch.Tensor]  # per layer [heads, n, dim], n = len(tokens) - 1
    values: list[torch.Tensor]
    routing: torch.Tensor | None  # [n, moe_layers, top_k]
    version: int

    @property
    def kv_len(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass
class SessionHit:
    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    routing: torch.Tensor | None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionStore:
    """Entries by key: a session id, or (``name="prompt"``) a whole prompt's token tuple."""

    def __init__(self, max_tokens: int, *, name: str = "session") -> None:
        self.max_tokens = max_tokens
        self.name = name
        self._entries: OrderedDict[Hashable, SessionEntry] = OrderedDict()
        self.tokens = 0
        self.lookups = self.hits = self.cached_tokens = self.prompt_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, session_id: Hashable, input_ids: list[int], version: int) -> SessionHit | None:
        self.lookups += 1
        self.prompt_tokens += len(input_ids)
        entry = self._entries.get(session_id)
        if entry is None or entry.version != version:
            return None
        self._entries.move_to_end(session_id)
        n = min(common_prefix(entry.tokens, input_ids), entry.kv_len, len(input_ids) - 1)
        if n <= 0:
            return None
        self.hits += 1
        self.cached_tokens += n
        routing = entry.routing[:n] if entry.routing is not None else None
        return SessionHit(n, [k[:, :n] for k in entry.keys], [v[:, :n] for v in entry.values], routing)

    def put(self, session_id: Hashable, entry: SessionEntry) -> None:
        if self.max_tokens <= 0 or entry.kv_len > self.max_tokens:
            self.drop(session_id)
            return
        self.drop(session_id)
        self._entries[session_id] = entry
        self.tokens += entry.kv_len
        while self.tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.kv_len
            self.evictions += 1

    def drop(self, session_id: Hashable) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self.tokens -= old.kv_len

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self._entries.values())

    def stats(self) -> dict[str, float | int]:
        n = self.name
        return {
            f"{n}_lookups": self.lookups,
            f"{n}_hits": self.hits,
            f"{n}_hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            f"{n}_cached_tokens": self.cached_tokens,
            f"{n}_token_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            f"{n}_cache_entries": len(self._entries),
            f"{n}_cache_tokens": self.tokens,
            f"{n}_cache_evictions": self.evictions,
        }
