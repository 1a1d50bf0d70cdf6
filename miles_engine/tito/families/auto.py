"""The chat family from the model: its type and its own chat template pick a registered family
(``qwen3``, ``glm``, ``chatml``); a template none of them matches gets the ``template`` family,
which renders with the model's own Jinja template once it is proven append-only."""

from __future__ import annotations

from typing import Any

from miles_engine.models.source import chat_template, model_type, resolve

AUTO = "auto"

_QWEN3_TYPES = ("qwen3", "qwen3_moe", "qwen3_next")
_GLM_TYPES = ("glm4", "glm4_moe", "glm", "chatglm")


def family_for(model_type: str | None, template: str | None) -> str:
    """The registered family name for a model, from its template first, then its type."""
    mt = (model_type or "").lower()
    if template:
        if "[gMASK]" in template or "<|observation|>" in template:
            return "glm"
        if "<|im_start|>" in template:
            return "qwen3" if "<think>" in template or mt in _QWEN3_TYPES else "chatml"
        return "template"
    if mt in _QWEN3_TYPES:
        return "qwen3"
    if mt in _GLM_TYPES:
        return "glm"
    return "chatml"  # tiny / config models with an on-the-fly BPE: plain ChatML


def family_from_source(model: Any) -> str:
    src = resolve(model)
    return family_for(model_type(src), chat_template(src))


def resolve_family_name(name: str, model: Any, tokenizer: Any = None) -> str:
    """``name`` unless it is ``auto``: then the family of ``model`` (or of the tokenizer's own
    template when there is no model source to read)."""
    if name != AUTO:
        return name
    if isinstance(model, str) and not model.startswith("tiny:"):
        return family_from_source(model)
    return family_for(None, getattr(tokenizer, "chat_template", None))
