"""The policy's codec (tokenizer + chat family) and model, as the recipe asks for them."""

from __future__ import annotations

from typing import Any

from miles_engine.config.recipe import RecipeConfig
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub


def bootstrap_codec(hub: Hub, cfg: RecipeConfig) -> Any:
    """A codec good enough to render text (the policy tokenizer is trained on that text)."""
    from miles_engine.tito import make_codec, resolve_family

    family = resolve_family(cfg.chat_family.name, cfg.chat_family.options, hub)
    return make_codec(family, f"builtin:bpe-{family.name}" if family.name in ("chatml", "qwen3", "glm")
                      else "builtin:bpe-chatml")


def demonstrations(source: Any, n: int, seed: int, wrong_fraction: float | None = None) -> list[Any]:
    make = getattr(source, "demonstrations", None)
    if make is None:
        raise ConfigError(f"environment '{getattr(source, 'name', source)}' provides no demonstrations: set "
                          f"tokenizer.path (a trained tokenizer) and sft.enabled=false, or pick an environment "
                          f"with demonstrations (e.g. shell-drills)")
    return list(make(n, seed=seed, wrong_fraction=wrong_fraction))


def build_codec(cfg: RecipeConfig, hub: Hub, source: Any) -> Any:
    from miles_engine.tito import make_codec
    from miles_engine.tito.messages import normalize_messages, normalize_tools
    from miles_engine.run.policy import pretrained_codec
    from miles_engine.models.policy_tokenizer import policy_tokenizer

    codec = pretrained_codec(hub, cfg)  # model.path: the model's own tokenizer and chat template
    if codec is not None:
        return codec
    texts: list[str] = []
    if not cfg.tokenizer.path:
        boot = bootstrap_codec(hub, cfg)
        if cfg.sft.dataset is not None:  # the transcripts are the corpus
            from miles_engine.train.sft_data import corpus_texts

            texts = corpus_texts(cfg.sft.dataset, boot, cfg.tokenizer.corpus_demos, source)
        for d in [] if texts else demonstrations(source, cfg.tokenizer.corpus_demos, seed=cfg.seed + 17):
            texts.append(boot.render(normalize_messages(d.conversation()), normalize_tools(d.tools),
                                     add_generation_prompt=False))
    tokenizer = policy_tokenizer(cfg.chat_family.name, texts, cfg.tokenizer)
    return make_codec(cfg.chat_family.name, tokenizer, options=cfg.chat_family.options, hub=hub)


def build_policy(cfg: RecipeConfig, codec: Any) -> Any:
    """``model.path`` as given, or the recipe's tiny model (random init, seeded) on the codec's vocabulary."""
    from miles_engine.models.tiny import build_config, build_model

    m = cfg.model
    if m.path:
        return m.path
    tok = codec.tokenizer
    config = build_config(m, tok.vocab_size, bos_id=None, eos_id=codec.stop_ids[0],
                          pad_id=tok.added_tokens.get("<|endoftext|>", 0))
    return build_model(config, cfg.seed)
