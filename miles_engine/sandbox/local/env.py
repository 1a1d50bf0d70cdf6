"""The sandbox environment: rebuilt from an allowlist; nothing else from the host leaks in."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host variables that carry no secrets and that tools need to behave (locale, terminal, zone).
HOST_ALLOWLIST: tuple[str, ...] = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TERM", "TZ")
# Every sandbox process carries this; the backend finds stray processes of a sandbox by it.
MARKER_VAR = "MILES_SANDBOX_ID"


def build_env(
    *,
    sandbox_id: str,
    home: str,
    user: str,
    tmpdir: str | None,
    passthrough: Iterable[str] = (),
    spec_env: Mapping[str, str] | None = None,
    exec_env: Mapping[str, str] | None = None,
    host_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return the complete environment of one sandboxed command.

    Order (later wins): defaults, allowlisted host variables, ``spec_env``, ``exec_env``;
    the sandbox marker is always set last so a task cannot hide its processes.
    """
    host = os.environ if host_env is None else host_env
    env: dict[str, str] = {
        "PATH": DEFAULT_PATH,
        "HOME": home,
        "USER": user,
        "LOGNAME": user,
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }
    if tmpdir:
        env["TMPDIR"] = tmpdir
    for name in (*HOST_ALLOWLIST, *passthrough):
        if name in host:
            env[name] = host[name]
    for extra in (spec_env, exec_env):
        if extra:
            for key, value in extra.items():
                env[str(key)] = str(value)
    env[MARKER_VAR] = sandbox_id
    return env
