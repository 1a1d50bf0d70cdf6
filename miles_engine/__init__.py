"""miles-engine: a plugin hub of agentic environments with an async RL post-training engine.

Plugin authors write ``from miles_engine import hookimpl`` and register components through
the hooks in :mod:`miles_engine.hookspecs`.
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

PROJECT_NAME = "miles"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

try:
    __version__ = version("miles-engine")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["PROJECT_NAME", "__version__", "hookimpl", "hookspec"]
