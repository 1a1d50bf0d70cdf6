"""The ``template`` chat family: renders with the model's own Jinja chat template.

Turn boundaries are derived from the template on the tokenizer it is bound to: the assistant
opener is what ``add_generation_prompt`` adds, the turn's closing text is what follows an
assistant message's content, its first added token is the stop token, and the rest of the
closing text (ChatML: ``\\n``) is the boundary merge. Tool calls are parsed as Hermes
``<tool_call>`` JSON when the template renders them so, reasoning as ``<think>`` when it renders
``reasoning_content`` in one.

Binding runs the append-only conformance check (:mod:`miles_engine.tito.check`) on the
representative conversations; a template that fails is refused, naming the conversation, the
turn and the first differing token, and the registered family to use instead.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from miles_engine.components import Section
from miles_engine.errors import ConfigError
from miles_engine.models.tokenizer import TitoTokenizer
from miles_engine.tito.check import check_rendering
from miles_engine.tito.conversations import adapt, builtin_conversations, load_conversations
from miles_engine.tito.families.auto import family_for
from miles_engine.tito.families.base import ChatCodec, ChatFamily, ParsedTurn, compile_template
from miles_engine.tito.messages import template_view
from miles_engine.tito.parsers import parse_hermes_tool_calls, split_reasoning

_PROBE = "Zq7Probe"
_REASON = "Rq7Probe"
_USER = {"role": "user", "content": "U"}


class TemplateFamilyOptions(Section):
    template: str | None = Field(None, description="Jinja chat template source (default: the tokenizer's own, "
                                                   "from tokenizer_config.json or the GGUF metadata)")
    template_file: str | None = Field(None, description="read the Jinja template from this file instead")
    conversations: str | None = Field(None, description="prove append-only on these conversations (JSON / JSON "
                                                        "lines) instead of the built-in representative set")
    check: bool = Field(True, description="run the conformance check when binding (refuse a failing template)")


class TemplateFamily(ChatFamily):
    """Unbound: holds the options; :meth:`bind` derives the boundaries and proves them."""

    name = "template"

    def __init__(self, options: Any = None, **template_kwargs: Any) -> None:
        self.options = options if isinstance(options, TemplateFamilyOptions) else \
            TemplateFamilyOptions(**(options.model_dump() if hasattr(options, "model_dump") else dict(options or {})))
        super().__init__(None, **template_kwargs)
        self.end_tail = ""
        self.tool_calls = False

    def source(self, tokenizer: TitoTokenizer) -> str:
        o = self.options
        if o.template_file:
            try:
                return Path(o.template_file).expanduser().read_text()
            except OSError as exc:
                raise ConfigError(f"chat_family.options.template_file: cannot read {o.template_file}: {exc}") from None
        text = o.template or tokenizer.chat_template
        if not text:
            raise ConfigError(f"chat family 'template': the tokenizer {tokenizer.name!r} carries no chat template "
                              f"(tokenizer_config.json chat_template / GGUF tokenizer.chat_template); set "
                              f"chat_family.options.template or use a registered family (qwen3, glm, chatml)")
        return text

    # ---- derivation -----------------------------------------------------------------------
    def _render(self, template: Any, messages: list[dict[str, Any]], gen: bool, tools: Any = None) -> str:
        return template.render(messages=[template_view(m) for m in messages], tools=tools,
                               add_generation_prompt=gen, **self.template_kwargs)

    def derived(self, tokenizer: TitoTokenizer) -> TemplateFamily:
        """A copy with the template, stop tokens, boundary merge and parsers of this tokenizer."""
        source = self.source(tokenizer)
        fam = copy.copy(self)
        fam.template = source
        tpl = compile_template(source)
        asst = {"role": "assistant", "content": _PROBE, "reasoning_content": None, "tool_calls": []}
        try:
            before = self._render(tpl, [_USER], False)
            prompt = self._render(tpl, [_USER], True)
            turn = self._render(tpl, [_USER, asst], False)
        except Exception as exc:
            raise ConfigError(f"chat family 'template': the template does not render a user/assistant exchange: "
                              f"{type(exc).__name__}: {exc}") from None
        if not prompt.startswith(before) or not turn.startswith(prompt) or _PROBE not in turn[len(prompt):]:
            raise ConfigError("chat family 'template': the generation prompt is not a prefix of the rendered "
                              "assistant turn, so the sampled tokens cannot be appended to the prompt; use a "
                              "registered family (qwen3, glm, chatml)")
        closing = turn[len(prompt):].split(_PROBE, 1)[1]
        ids = tokenizer.encode(closing)
        stop = next((i for i in ids if i in tokenizer.added_ids), None)
        if stop is None:
            raise ConfigError(f"chat family 'template': the template closes an assistant turn with {closing!r}, "
                              f"which holds no added token of the tokenizer: the model cannot signal the end of "
                              f"its turn; use a registered family (qwen3, glm, chatml)")
        stop_text = tokenizer.piece(stop)
        fam.end_tail = closing.split(stop_text, 1)[1]
        eos = [t for t in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>") if t in tokenizer.added_tokens]
        fam.stop_tokens = tuple(dict.fromkeys([stop_text, *eos]))
        call = {"id": "c1", "name": "bash", "arguments": '{"command": "ls"}'}
        try:
            with_call = self._render(tpl, [_USER, {**asst, "content": "", "tool_calls": [call]}], False)
            fam.tool_calls = "<tool_call>" in with_call and '"ls"' in with_call
            with_reason = self._render(tpl, [_USER, {**asst, "reasoning_content": _REASON}], False)
            fam.has_reasoning = _REASON in with_reason and "<think>" in with_reason
        except Exception:  # templates that cannot render tool calls or reasoning parse neither
            fam.tool_calls = fam.has_reasoning = False
        return fam

    def bind(self, tokenizer: TitoTokenizer) -> ChatCodec:
        fam = self.derived(tokenizer)
        codec = ChatCodec(fam, tokenizer)
        if self.options.check:
            prove(codec, self.options.conversations)
        return codec

    # ---- hooks ----------------------------------------------------------------------------
    def merge(self, codec: ChatCodec, last_id: int | None, suffix: list[int]) -> tuple[list[int], list[int]]:
        if last_id is None:
            return [], suffix
        tail = list(codec.constant_ids(self.end_tail)) if self.end_tail else []
        if last_id == codec.stop_ids[0]:
            return tail, suffix
        return [codec.stop_ids[0], *tail], suffix

    def parse(self, text: str, *, kwargs: dict[str, Any], tools: Sequence[dict[str, Any]],
              parse_tools: bool) -> ParsedTurn:
        reasoning = None
        if self.has_reasoning:
            reasoning, text = split_reasoning(text, prompt_closed=not self.thinking(kwargs))
        found = parse_hermes_tool_calls(text) if parse_tools and self.tool_calls else None
        if found is None:
            return ParsedTurn(content=text, reasoning=reasoning)
        return ParsedTurn(content=found[0], reasoning=reasoning, calls=found[1])


def prove(codec: ChatCodec, conversations: str | None = None) -> None:
    """Refuse (``ConfigError``) unless the conformance check passes on ``codec``'s tokenizer."""
    fam = codec.family
    convs = load_conversations(conversations) if conversations else [
        adapt(c, has_reasoning=fam.has_reasoning) for c in builtin_conversations()
        if fam.tool_calls or not any(m.get("tool_calls") for m in c["messages"])]
    failed = [f for f in check_rendering(codec, convs) if not f.ok]
    if not failed:
        return
    first = failed[0]
    suggestion = family_for(None, fam.template)
    instead = (f"use chat_family: {suggestion}" if suggestion != "template"
               else "use a registered family (qwen3, glm, chatml) or a plugin family")
    raise ConfigError(
        f"chat family 'template' refused for tokenizer {codec.tokenizer.name!r}: the model's chat template fails "
        f"`miles tito check` ({first.check}) on conversation '{first.conversation}': {first.message}. "
        f"{instead} (chat_family.options.check=false skips this proof at your own risk)")
