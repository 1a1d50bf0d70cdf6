"""SGLang-compatible HTTP for rollout engines: a server for any RolloutEngine and one client
that speaks to it and to a real SGLang server. Wire format details live in :mod:`.wire`.
Importing this package imports nothing heavy."""

# module:function that builds the engine a standalone server runs (``miles serve``).
DEFAULT_ENGINE_FACTORY = "miles_engine.engines.embedded:load_engine"
