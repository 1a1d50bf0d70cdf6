"""The embedded rollout engine: in-process PyTorch, CPU or GPU, any transformers causal LM.

Public surface: :class:`EmbeddedEngine` (implements ``RolloutEngine``),
:class:`EmbeddedEngineOptions`, and :func:`load_engine` (the factory the HTTP server uses).
Importing this package does not import torch; the engine modules do, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_engine.engines.embedded.options import EmbeddedEngineOptions

if TYPE_CHECKING:
    from miles_engine.engines.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine", "EmbeddedEngineOptions", "load_engine"]


def __getattr__(name: str) -> Any:
    if name == "EmbeddedEngine":
        from miles_engine.engines.embedded.engine import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_engine(model: str, *, dtype: str | None = None, threads: int | None = None, **options: Any) -> EmbeddedEngine:
    """Build an engine from a model spec string: a model directory, a ``.gguf`` file, a
    ``config.json`` (random init), or ``tiny:<model_type>[,key=value...]``."""
    from miles_engine.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_model(model, dtype=dtype or "float32", num_threads=threads or 1, **options)
