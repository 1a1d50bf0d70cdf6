"""What the training stack builds for a pretrained policy (``model.path`` set): the codec over the
model's own tokenizer (``tokenizer.path`` overrides it) instead of a BPE trained at start-up."""

from __future__ import annotations

from typing import Any


def pretrained_codec(hub: Any, cfg: Any) -> Any | None:
    """The codec for a recipe whose policy comes from a model source, or ``None`` (tiny policy:
    the stack trains its tokenizer). The chat family ``auto`` is the model's own."""
    if not cfg.model.path or cfg.tokenizer.path:
        return None
    from miles_engine.tito.families.auto import resolve_family_name
    from miles_engine.models.source import resolve
    from miles_engine.models.tokenizer import source_tokenizer
    from miles_engine.tito import make_codec

    tokenizer = source_tokenizer(resolve(cfg.model.path))
    family = resolve_family_name(cfg.chat_family.name, cfg.model.path, tokenizer)
    return make_codec(family, tokenizer, options=cfg.chat_family.options, hub=hub)


def check_model_section(cfg: Any) -> str | None:
    """For ``miles recipes validate``: resolve ``model.path`` without loading weights, and say what
    the run would build (kind, model type, tokenizer, chat family); ``None`` without a model path."""
    if not cfg.model.path:
        return None
    from miles_engine.tito.families.auto import AUTO, family_for
    from miles_engine.models.source import chat_template, model_type, resolve
    from miles_engine.models.tokenizer import tokenizer_origin

    src = resolve(cfg.model.path)
    mtype = model_type(src)
    if src.kind == "config" and not mtype:
        from miles_engine.errors import ConfigError

        raise ConfigError(f"model.path {src.path}: config.json has no 'model_type' (e.g. \"qwen3\")")
    tok = cfg.tokenizer.path or tokenizer_origin(src)
    own = family_for(mtype, chat_template(src))
    family = own if cfg.chat_family.name == AUTO else cfg.chat_family.name
    note = "" if family == own else f" (the model's type and template imply '{own}')"
    init = "random init" if src.kind == "config" else "pretrained weights"
    return f"model {src.kind} {src.path} ({mtype}, {init}); tokenizer {tok}; chat family {family}{note}"
