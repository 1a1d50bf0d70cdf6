"""The policy a recipe asks for: its codec (tokenizer + chat family) and its model.

A pretrained policy (``model.path``) brings its own tokenizer and chat template (``tokenizer.path``
overrides it; chat family ``auto`` is the model's own); a tiny policy gets a byte-level BPE trained
at start-up on the environment's own text (or ``sft.dataset``'s transcripts) and a Qwen3 model
from scratch on that vocabulary. ``miles train``, ``miles eval --checkpoint`` and the benches all
build it here, so a checkpoint's token ids mean what they meant in training.
"""

from __future__ import annotations

from typing import Any

from miles_engine.config.recipe import RecipeConfig
from miles_engine.environments.capabilities import demonstrations
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub
from miles_engine.models.policy_tokenizer import policy_tokenizer
from miles_engine.models.source import chat_template, model_type, resolve
from miles_engine.models.tiny import build_config, build_model
from miles_engine.models.tokenizer import source_tokenizer, tokenizer_origin
from miles_engine.sft.dataset import corpus_texts
from miles_engine.tito import make_codec, resolve_family
from miles_engine.tito.families.auto import AUTO, family_for, resolve_family_name
from miles_engine.tito.messages import normalize_messages, normalize_tools


def build_codec(cfg: RecipeConfig, hub: Hub, source: Any) -> Any:
    codec = pretrained_codec(hub, cfg)  # model.path: the model's own tokenizer and chat template
    if codec is not None:
        return codec
    texts: list[str] = []
    if not cfg.tokenizer.path:
        boot = bootstrap_codec(hub, cfg)
        if cfg.sft.dataset is not None:  # the transcripts are the corpus
            texts = corpus_texts(cfg.sft.dataset, boot, cfg.tokenizer.corpus_demos, source)
        for d in [] if texts else demonstrations(source, cfg.tokenizer.corpus_demos, seed=cfg.seed + 17):
            texts.append(boot.render(normalize_messages(d.conversation()), normalize_tools(d.tools),
                                     add_generation_prompt=False))
    tokenizer = policy_tokenizer(cfg.chat_family.name, texts, cfg.tokenizer)
    return make_codec(cfg.chat_family.name, tokenizer, options=cfg.chat_family.options, hub=hub)


def bootstrap_codec(hub: Hub, cfg: RecipeConfig) -> Any:
    """A codec good enough to render text (the policy tokenizer is trained on that text)."""
    family = resolve_family(cfg.chat_family.name, cfg.chat_family.options, hub=hub)
    return make_codec(family, f"builtin:bpe-{family.name}" if family.name in ("chatml", "qwen3", "glm")
                      else "builtin:bpe-chatml", hub=hub)


def pretrained_codec(hub: Hub, cfg: RecipeConfig) -> Any | None:
    """The codec for a recipe whose policy comes from a model source, or ``None`` (tiny policy:
    the stack trains its tokenizer). The chat family ``auto`` is the model's own."""
    if not cfg.model.path or cfg.tokenizer.path:
        return None
    tokenizer = source_tokenizer(resolve(cfg.model.path))
    family = resolve_family_name(cfg.chat_family.name, cfg.model.path, tokenizer)
    return make_codec(family, tokenizer, options=cfg.chat_family.options, hub=hub)


def build_policy(cfg: RecipeConfig, codec: Any) -> Any:
    """``model.path`` as given, or the recipe's tiny model (random init, seeded) on the codec's vocabulary."""
    m = cfg.model
    if m.path:
        return m.path
    tok = codec.tokenizer
    config = build_config(m, tok.vocab_size, bos_id=None, eos_id=codec.stop_ids[0],
                          pad_id=tok.added_tokens.get("<|endoftext|>", 0))
    return build_model(config, cfg.seed)


def check_model_section(cfg: RecipeConfig) -> str | None:
    """For ``miles recipes validate``: resolve ``model.path`` without loading weights, and say what
    the run would build (kind, model type, tokenizer, chat family); ``None`` without a model path."""
    if not cfg.model.path:
        return None
    src = resolve(cfg.model.path)
    mtype = model_type(src)
    if src.kind == "config" and not mtype:
        raise ConfigError(f"model.path {src.path}: config.json has no 'model_type' (e.g. \"qwen3\")")
    tok = cfg.tokenizer.path or tokenizer_origin(src)
    own = family_for(mtype, chat_template(src))
    family = own if cfg.chat_family.name == AUTO else cfg.chat_family.name
    note = "" if family == own else f" (the model's type and template imply '{own}')"
    init = "random init" if src.kind == "config" else "pretrained weights"
    return f"model {src.kind} {src.path} ({mtype}, {init}); tokenizer {tok}; chat family {family}{note}"
