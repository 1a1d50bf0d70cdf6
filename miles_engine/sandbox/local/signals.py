"""Default signal dispositions for sandboxed commands, whoever started this process.

An ignored signal survives fork and exec, and a shell cannot reset a signal it was started
with ignored. A driver started as a background job of a script (``cmd &``: SIGINT and SIGQUIT
ignored) or under ``nohup`` (SIGHUP) would pass that on to every sandbox's PID 1 and command:
Ctrl-C-style stops, ``kill -INT`` and timeouts would not reach them. The host side of every
sandbox start and command therefore resets them before exec.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

RESET = ("INT", "QUIT", "TERM", "HUP", "USR1", "USR2", "ALRM")  # SIGPIPE: Popen restores it itself
_env_ok: bool | None = None


def ignored() -> list[str]:
    """The signals of :data:`RESET` this process ignores (children would inherit that)."""
    return [name for name in RESET if signal.getsignal(getattr(signal, f"SIG{name}")) == signal.SIG_IGN]


def env_prefix(names: list[str]) -> list[str] | None:
    """``env --default-signal=...`` (coreutils >= 8.31) to exec in front of a command; ``[]``
    when nothing is ignored, ``None`` when ``env`` lacks the option (use :func:`preexec_reset`)."""
    global _env_ok
    if not names:
        return []
    if _env_ok is None:
        try:
            _env_ok = subprocess.run(["env", "--default-signal=INT", "true"], capture_output=True,
                                     timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _env_ok = False
    return ["env", f"--default-signal={','.join(names)}"] if _env_ok else None


def preexec_reset(names: list[str]) -> Callable[[], None]:
    signums = [getattr(signal, f"SIG{name}") for name in names]

    def reset() -> None:
        for signum in signums:
            signal.signal(signum, signal.SIG_DFL)

    return reset
