"""A chat family: template, stop tokens, boundary merge and parsers, bound to a tokenizer.

The token row grows in two ways only. Sampled ids are appended verbatim. Between two
generations the server appends *environment ids*:

1. the **boundary merge** (:meth:`ChatFamily.merge`): what the template puts between the last
   sampled token and the next message, given the token the model actually stopped on
   (ChatML: the ``\\n`` after ``<|im_end|>`` the model never samples; GLM: nothing, and the next
   message's opener is dropped when the model already sampled it as its stop token);
2. the **suffix**: the appended messages plus the assistant opener, rendered by the template
   behind a fixed dummy prefix (``[user, assistant]``) and tokenized alone. Every message
   opens with a special token, so BPE cannot merge across the boundary and the suffix ids
   equal the ids a full canonical render would have there.

Templates must therefore be append-only at assistant boundaries: rendering ``H + [assistant]``
must be a prefix of rendering ``H + [assistant] + more``. ``miles tito check`` verifies it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.tito.errors import TemplateError
from miles_engine.tito.messages import Message, template_view
from miles_engine.tito.parsers import ParsedCall
from miles_engine.models.tokenizer import TitoTokenizer

TEXT_CACHE_ENTRIES = 4096  # remembered tokenizations of whole conversations (by text) ...
TEXT_CACHE_MAX_CHARS = 16384  # ... of at most this many characters each
DUMMY_PREFIX: tuple[Message, ...] = (
    {"role": "user", "content": "."},
    {"role": "assistant", "content": ".", "reasoning_content": None, "tool_calls": []},
)


@dataclass
class ParsedTurn:
    """What the parsers made of one generation."""

    content: str
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)


def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.cache
def compile_template(source: str) -> Any:
    from jinja2.exceptions import TemplateError as JinjaError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise JinjaError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class ChatFamily:
    """Base class. Subclasses set the class attributes and may override the hooks."""

    name: str = ""
    template: str = ""
    stop_tokens: tuple[str, ...] = ()
    required_tokens: tuple[str, ...] = ()
    default_kwargs: dict[str, Any] = {}
    #: template kwargs a request may set through ``chat_template_kwargs``
    request_kwargs: tuple[str, ...] = ()
    has_reasoning: bool = False
    #: roles that may open the messages appended after an assistant turn (``None``: any)
    allowed_append_roles: tuple[str, ...] | None = None

    def __init__(self, options: Any = None, **template_kwargs: Any) -> None:
        """``options``: a pydantic options model or dict (a hub factory passes one); keyword
        arguments are template defaults too (``enable_thinking=False``)."""
        given = options.model_dump() if hasattr(options, "model_dump") else dict(options or {})
        self.template_kwargs = {**self.default_kwargs, **given, **template_kwargs}

    def bind(self, tokenizer: TitoTokenizer) -> ChatCodec:
        return ChatCodec(self, tokenizer)

    # ---- hooks -----------------------------------------------------------------------------
    def merge(self, codec: ChatCodec, last_id: int | None, suffix: list[int]) -> tuple[list[int], list[int]]:
        """Boundary merge: ``(ids inserted after the stored row, suffix ids to append)``.

        ``last_id`` is the last token of the stored row (the stop token the model sampled, or
        any token when it hit ``max_tokens``); ``None`` on an empty row.
        """
        return [], suffix

    def canonical_tail(self, codec: ChatCodec, last_id: int | None) -> list[int]:
        """Ids the diagnostic appends to a canonical render of a history that ends with an
        assistant message (GLM: the next-turn opener the model sampled as its stop token)."""
        return []

    def thinking(self, kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("enable_thinking", True))

    def parse(self, text: str, *, kwargs: dict[str, Any], tools: Sequence[dict[str, Any]],
              parse_tools: bool) -> ParsedTurn:
        return ParsedTurn(content=text)


class ChatCodec:
    """A family bound to a tokenizer: renders, tokenizes and merges. Thread-safe, cached."""

    def __init__(self, family: ChatFamily, tokenizer: TitoTokenizer) -> None:
        self.family = family
        self.tokenizer = tokenizer
        for tok in family.required_tokens:
            tokenizer.require_token(tok, family=family.name)
        # the first stop token is required; the others are used when the vocabulary has them
        tokenizer.require_token(family.stop_tokens[0], family=family.name)
        self.stop_ids: tuple[int, ...] = tuple(
            tokenizer.added_tokens[t] for t in family.stop_tokens if t in tokenizer.added_tokens)
        self._template = compile_template(family.template)
        self._prefix_cache: dict[tuple[str, str], str] = {}
        self._prompt_cache: dict[tuple[str, str, str], list[int]] = {}
        self._constants: dict[str, tuple[int, ...]] = {}
        self._text_ids: dict[str, tuple[int, ...]] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # to another process (a session-server actor): the compiled template is rebuilt there
        return type(self), (self.family, self.tokenizer)

    @property
    def name(self) -> str:
        return self.family.name

    def constant_ids(self, text: str) -> tuple[int, ...]:
        """``encode(text)`` for a fixed piece of template text, cached."""
        ids = self._constants.get(text)
        if ids is None:
            ids = self._constants[text] = tuple(self.tokenizer.encode(text))
        return ids

    def kwargs(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self.family.template_kwargs, **(overrides or {})}

    # ---- rendering ---------------------------------------------------------------------------
    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None, *,
               add_generation_prompt: bool, kwargs: dict[str, Any] | None = None) -> str:
        try:
            return self._template.render(
                messages=[template_view(m) for m in messages], tools=list(tools or []) or None,
                add_generation_prompt=add_generation_prompt, **self.kwargs(kwargs),
            )
        except Exception as exc:
            raise TemplateError(f"chat family '{self.name}' failed to render: {type(exc).__name__}: {exc}") from exc

    def encode_conversation(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None, *,
                            add_generation_prompt: bool, kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render the whole conversation once and tokenize it (turn 1, and the diagnostic).
        Tokenizations are remembered by text: the attempts of a group often end in the same
        conversation (the diagnostic's canonical encoding then runs once)."""
        text = self.render(messages, tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs)
        ids = self._text_ids.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text))
            if len(text) <= TEXT_CACHE_MAX_CHARS:
                if len(self._text_ids) >= TEXT_CACHE_ENTRIES:
                    self._text_ids.pop(next(iter(self._text_ids)))  # oldest first
                self._text_ids[text] = ids
        return list(ids)

    def encode_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None, *,
                      tools_key: str, kwargs: dict[str, Any] | None = None) -> list[int]:
        """:meth:`encode_conversation` of a first turn (with the generation prompt), remembered:
        the attempts of a GRPO group open with the same prompt, so the render and the
        tokenization run once per group, not once per attempt."""
        key = (tools_key, json.dumps(list(messages), sort_keys=True, default=str),
               json.dumps(self.kwargs(kwargs), sort_keys=True, default=str))
        ids = self._prompt_cache.get(key)
        if ids is None:
            ids = self.encode_conversation(messages, tools, add_generation_prompt=True, kwargs=kwargs)
            if len(self._prompt_cache) >= 1024:
                self._prompt_cache.pop(next(iter(self._prompt_cache)))  # oldest first
            self._prompt_cache[key] = ids
        return list(ids)

    def suffix_text(self, new_messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None, *,
                    kwargs: dict[str, Any] | None = None, tools_key: str | None = None) -> str:
        """Text the template appends for ``new_messages`` plus the assistant opener, after an
        assistant message."""
        kw = self.kwargs(kwargs)
        key = (tools_key if tools_key is not None else json.dumps(list(tools or []), sort_keys=True),
               json.dumps(kw, sort_keys=True, default=str))
        prefix = self._prefix_cache.get(key)
        if prefix is None:
            prefix = self.render(DUMMY_PREFIX, tools, add_generation_prompt=False, kwargs=kw)
            if len(self._prefix_cache) < 256:
                self._prefix_cache[key] = prefix
        full = self.render([*DUMMY_PREFIX, *new_messages], tools, add_generation_prompt=True, kwargs=kw)
        if not full.startswith(prefix):
            at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            raise TemplateError(
                f"chat family '{self.name}' is not append-only: appending messages changed the rendered "
                f"history at character {at} ({prefix[at:at + 30]!r} became {full[at:at + 30]!r})"
            )
        return full[len(prefix):]

    def append_ids(self, last_id: int | None, new_messages: Sequence[Message],
                   tools: Sequence[dict[str, Any]] | None = None, *, kwargs: dict[str, Any] | None = None,
                   tools_key: str | None = None) -> list[int]:
        """Environment ids to append after a stored row ending in ``last_id``: merge + suffix."""
        suffix = self.tokenizer.encode(self.suffix_text(new_messages, tools, kwargs=kwargs, tools_key=tools_key))
        close, suffix = self.family.merge(self, last_id, suffix)
        return close + suffix

    # ---- parsing -----------------------------------------------------------------------------
    def strip_stop(self, output_ids: Sequence[int]) -> list[int]:
        ids = list(output_ids)
        if ids and ids[-1] in self.stop_ids:
            ids.pop()
        return ids

    def parse_output(self, output_ids: Sequence[int], *, kwargs: dict[str, Any] | None = None,
                     tools: Sequence[dict[str, Any]] = (), parse_tools: bool = True) -> ParsedTurn:
        text = self.tokenizer.decode(self.strip_stop(output_ids))
        return self.family.parse(text, kwargs=self.kwargs(kwargs), tools=tools, parse_tools=parse_tools and bool(tools))
