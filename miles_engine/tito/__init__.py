"""TITO: token-in/token-out multi-turn sessions behind an OpenAI-compatible API.

The session server (:mod:`.server`, :mod:`.service`) owns every token row; chat families
(:mod:`.families`, plugins) render, merge and parse; :mod:`.check` is the conformance check
(``miles tito check``); :mod:`.agent` and :mod:`.external` are the agents that drive it.
Importing this package is cheap: FastAPI, Jinja and tokenizers load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_engine.hub import Hub
    from miles_engine.tito.families.base import ChatCodec, ChatFamily


def resolve_family(ref: Any, options: dict[str, Any] | None = None, *, hub: Hub) -> ChatFamily:
    """A chat family from a registered name (``qwen3``) or a dotted path (built by ``hub``), or an instance."""
    from miles_engine.errors import ConfigError
    from miles_engine.tito.families.base import ChatFamily

    if isinstance(ref, ChatFamily):
        return ref
    family = hub.create("chat_family", str(ref), options or {}, where=f"chat family '{ref}' options")
    if not isinstance(family, ChatFamily):
        raise ConfigError(f"chat family '{ref}' built a {type(family).__name__}, not a ChatFamily")
    return family


def make_codec(family: Any, tokenizer: Any, *, hub: Hub, options: dict[str, Any] | None = None) -> ChatCodec:
    """Bind a family (name, path or instance) to a tokenizer (object, path or ``builtin:`` spec)."""
    from miles_engine.models.tokenizer import load_tokenizer

    return resolve_family(family, options, hub=hub).bind(load_tokenizer(tokenizer))
