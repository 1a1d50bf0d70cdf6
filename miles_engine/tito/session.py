"""A session owns its token rows: an append-only tree of generations.

Each :class:`Node` is one generation: the environment ids the server appended before it
(boundary merge + appended messages + assistant opener; the whole rendered conversation for a
first turn) followed by the sampled ids, verbatim. A node's token row is the concatenation
along its path from the root, so a prefix is never re-tokenized.

A request is served in two steps, and only the second mutates anything:

1. :meth:`Session.plan` matches the replayed history against the stored paths (deepest
   match wins; ties go to the newest node), checks the session mode, and computes the ids to
   append. Pure: an error here leaves the session untouched.
2. :meth:`Session.commit` attaches the finished generation.

Modes: ``linear`` (the request must extend the current leaf, or retry it from its parent; the
retried generation is dropped) and ``branching`` (any stored node may be extended; every
kept leaf is a trajectory).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_engine.tito.errors import BadRequest, Conflict, SessionNotFound
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.matchers import Matcher
from miles_engine.tito.messages import Message

Mode = Literal["linear", "branching"]


@dataclass(eq=False)
class Node:
    seq: int
    parent: Node | None
    tools: list[dict[str, Any]]
    tools_key: str
    messages: list[Message]  # appended messages of the request, then the generated assistant message
    env_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routed_experts: list[Any] | None
    finish_reason: str
    kwargs: dict[str, Any]
    start: int  # row length before env_ids
    children: list[Node] = field(default_factory=list)
    row: list[int] | None = None  # cached full row, kept on leaves only
    match_memo: tuple[Message, ...] = ()  # the replayed messages that matched last (identity fast path)
    created: float = field(default_factory=time.time)

    @property
    def completion_start(self) -> int:
        return self.start + len(self.env_ids)

    @property
    def end(self) -> int:
        return self.completion_start + len(self.output_ids)

    @property
    def delta(self) -> list[Message]:
        return self.messages[:-1]

    def path(self) -> list[Node]:
        out: list[Node] = []
        node: Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out


@dataclass
class Plan:
    """What a request will append, computed without touching the session."""

    parent: Node | None
    delta: list[Message]
    env_ids: list[int]
    input_ids: list[int]
    tools: list[dict[str, Any]]
    tools_key: str
    kwargs: dict[str, Any]
    replaces: Node | None = None


def full_row(node: Node, leaf: Node | None = None) -> list[int]:
    """The token row through ``node``'s sampled ids (``leaf``: a cached descendant to slice)."""
    if node.row is not None:
        return node.row
    if leaf is not None and leaf.row is not None and len(leaf.row) >= node.end:
        return leaf.row[: node.end]
    return list(itertools.chain.from_iterable(itertools.chain(n.env_ids, n.output_ids) for n in node.path()))


class Session:
    def __init__(self, session_id: str, codec: ChatCodec, matcher: Matcher, *, mode: Mode = "linear",
                 max_nodes: int = 1024, drop_retries: bool = True, metadata: dict[str, Any] | None = None,
                 diagnose: bool = True) -> None:
        self.id = session_id
        self.codec = codec
        self.matcher = matcher
        self.mode: Mode = mode
        self.max_nodes = max_nodes
        self.drop_retries = drop_retries
        self.metadata = dict(metadata or {})
        self.roots: list[Node] = []
        self.nodes: dict[int, Node] = {}
        self.leaf: Node | None = None  # linear mode: the current end of the row
        self.busy = False
        self.closed = False
        self.inflight: set[str] = set()
        self.created = self.last_used = time.time()
        self._seq = itertools.count(1)
        self.diagnostics: dict[int, dict[str, Any]] = {}
        self.diagnose = diagnose  # whether reports carry tito_session_mismatch (SessionServerConfig.diagnose_every)
        self.parse_cache: list[tuple[Any, Message]] = []
        self.responses: dict[str, list[Message]] = {}  # Responses API: response id -> its whole conversation
        self.wires: collections.Counter[str] = collections.Counter()  # committed turns per wire format
        # Messages / Responses: (history translation cache, normalisation cache) of the last request
        self.wire_history: dict[str, tuple[Any, list[tuple[Any, Message]]]] = {}

    # ---- matching ------------------------------------------------------------------------------
    def _match(self, node: Node, messages: list[Message], start: int) -> int | None:
        end = start + len(node.messages)
        if end > len(messages):
            return None
        replayed = messages[start:end]
        memo = node.match_memo
        if len(memo) == len(replayed) and all(a is b for a, b in zip(memo, replayed)):
            return end  # the very objects that matched before (normalisation cache)
        for stored, other in zip(node.messages, replayed):
            if not self.matcher(stored, other):
                return None
        node.match_memo = tuple(replayed)
        return end

    def find_attach(self, messages: list[Message], tools_key: str) -> tuple[Node | None, int]:
        """Deepest stored node whose path is a prefix of ``messages`` (ties: newest)."""
        best: tuple[Node | None, int] = (None, 0)
        stack = [(n, 0) for n in self.roots if n.tools_key == tools_key]
        while stack:
            node, start = stack.pop()
            end = self._match(node, messages, start)
            if end is None:
                continue
            if end > best[1] or (end == best[1] and best[0] is not None and node.seq > best[0].seq):
                best = (node, end)
            stack.extend((c, end) for c in node.children)
        return best

    def _divergence(self, messages: list[Message], tools_key: str) -> str:
        assert self.leaf is not None
        if self.leaf.tools_key != tools_key:
            return "the request's tools differ from the session's"
        stored = [m for n in self.leaf.path() for m in n.messages]
        for i, (a, b) in enumerate(zip(stored, messages)):
            if not self.matcher(a, b):
                return f"messages[{i}] ({b['role']}) differs from the session's history"
        return f"the request has {len(messages)} messages, fewer than the session's {len(stored)}"

    # ---- planning ------------------------------------------------------------------------------
    def plan(self, messages: list[Message], tools: list[dict[str, Any]], tools_key: str,
             kwargs: dict[str, Any]) -> Plan:
        if self.closed:
            raise SessionNotFound(f"session '{self.id}' was deleted")
        parent, consumed = self.find_attach(messages, tools_key)
        replaces = None
        if self.mode == "linear" and self.leaf is not None and parent is not self.leaf:
            if parent is not self.leaf.parent:
                raise Conflict(
                    f"history diverges deeper than the last assistant turn: {self._divergence(messages, tools_key)}. "
                    "A linear session can only append to its history or retry its last assistant turn; "
                    "create the session with {\"mode\": \"branching\"} for non-linear histories",
                    code="history_diverged",
                )
            replaces = self.leaf
        if self.mode == "branching" and len(self.nodes) >= self.max_nodes:
            raise Conflict(f"session '{self.id}' holds {self.max_nodes} generations, its cap", code="session_full")
        delta = messages[consumed:]
        if replaces is not None:
            replayed = next((i for i, m in enumerate(delta) if m["role"] == "assistant"), None)
            if replayed is not None:  # not a retry: the client rewrote the generation it got
                i = consumed + replayed
                raise Conflict(
                    f"messages[{i}] (assistant) does not match the assistant turn the server generated there "
                    f"(matcher compares role, content, reasoning when sent, tool-call ids/names/arguments): replay "
                    f"it unchanged, or open the session with matcher 'loose_tool_call' or 'role_content_only'",
                    code="assistant_mismatch", param=f"messages[{i}]")
        allowed = self.codec.family.allowed_append_roles
        if parent is not None and delta and allowed is not None and delta[0]["role"] not in allowed:
            raise BadRequest(
                f"chat family '{self.codec.name}' cannot append a '{delta[0]['role']}' message right after an "
                f"assistant turn (the model ends its turn on the next message's opener; allowed: "
                f"{', '.join(allowed)}): send it after a user message", param=f"messages[{consumed}].role")
        if parent is None:
            env_ids = self.codec.encode_prompt(messages, tools, tools_key=tools_key, kwargs=kwargs)
            input_ids = list(env_ids)
        else:
            row = full_row(parent, self.leaf if self.mode == "linear" else None)
            env_ids = self.codec.append_ids(row[-1] if row else None, delta, tools, kwargs=kwargs, tools_key=tools_key)
            input_ids = row + env_ids
        return Plan(parent, delta, env_ids, input_ids, tools, tools_key, kwargs, replaces)

    # ---- committing ----------------------------------------------------------------------------
    def commit(self, plan: Plan, *, assistant: Message, output_ids: list[int], logprobs: list[float],
               versions: list[int], routed_experts: list[Any] | None, finish_reason: str) -> Node:
        if self.closed:
            raise SessionNotFound(f"session '{self.id}' was deleted while the request was generating")
        node = Node(
            seq=next(self._seq), parent=plan.parent, tools=plan.tools, tools_key=plan.tools_key,
            messages=[*plan.delta, assistant], env_ids=plan.env_ids, output_ids=list(output_ids),
            logprobs=list(logprobs), versions=list(versions), routed_experts=routed_experts,
            finish_reason=finish_reason, kwargs=plan.kwargs,
            start=len(plan.input_ids) - len(plan.env_ids),
        )
        node.row = plan.input_ids + node.output_ids
        if plan.replaces is not None:
            self._drop(plan.replaces)
        siblings = plan.parent.children if plan.parent is not None else self.roots
        siblings.append(node)
        if plan.parent is not None:
            plan.parent.row = None  # keep cached rows on leaves only
        self.nodes[node.seq] = node
        if self.mode == "linear":
            self.leaf = node
        self.last_used = time.time()
        return node

    def _drop(self, node: Node) -> None:
        siblings = node.parent.children if node.parent is not None else self.roots
        siblings.remove(node)
        for n in [node, *self._descendants(node)]:
            self.nodes.pop(n.seq, None)
            self.diagnostics.pop(n.seq, None)

    def _descendants(self, node: Node) -> list[Node]:
        out, stack = [], list(node.children)
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children)
        return out

    # ---- leaves --------------------------------------------------------------------------------
    def kept_leaves(self) -> list[Node]:
        """Leaves that are trajectories, oldest first. With ``drop_retries`` a leaf is dropped
        when a node on its path was retried: a newer sibling was generated from the same request."""
        if self.mode == "linear":
            return [self.leaf] if self.leaf is not None else []
        leaves = [n for n in self.nodes.values() if not n.children]
        if self.drop_retries:
            leaves = [leaf for leaf in leaves if not any(self._retried(n) for n in leaf.path())]
        return sorted(leaves, key=lambda n: n.seq)

    def _retried(self, node: Node) -> bool:
        siblings = node.parent.children if node.parent is not None else self.roots
        return any(
            s.seq > node.seq and s.tools_key == node.tools_key and len(s.delta) == len(node.delta)
            and all(self.matcher(a, b) for a, b in zip(node.delta, s.delta))
            for s in siblings
        )
