"""Built-in chat families. Third-party families subclass :class:`ChatFamily` and register a
factory through ``miles_register_chat_families``."""

from miles_engine.tito.families.base import ChatCodec, ChatFamily, ParsedTurn
from miles_engine.tito.families.chatml import ChatMLFamily
from miles_engine.tito.families.glm import GLMFamily
from miles_engine.tito.families.qwen3 import Qwen3Family

__all__ = ["ChatCodec", "ChatFamily", "ChatMLFamily", "GLMFamily", "ParsedTurn", "Qwen3Family"]
