"""Shell scripts that give every remote backend the local backend's ``exec`` semantics.

Cloud SDKs disagree on the basics: Daytona merges stdout and stderr, E2B raises on a non-zero
exit, Modal reports a timeout as exit code -1, and none caps output. So a remote ``exec`` does
not hand the model's command to the SDK directly: it sends one POSIX ``sh`` wrapper that

- starts the command in its own session (``setsid``) with stdout and stderr going to two files
  in a per-exec directory under :data:`EXEC_ROOT`,
- enforces the timeout itself (a watchdog sends TERM to the whole process group, KILL after a
  grace period, and leaves a ``timeout`` marker so a command exiting 124 is never mistaken for
  a timeout),
- prints one framed reply on its own stdout: exit code, timeout flag, full stream sizes and the
  first ``cap`` bytes of each stream in base64,
- also leaves that reply's parts in files (``status`` written last, atomically), so a caller
  whose stream dropped can collect the result later without re-running the command.

The SDK therefore sees a command that always exits 0 with one small stdout, whatever the
model's command did; :func:`parse_reply` turns it back into an :class:`ExecReply`.
"""

from __future__ import annotations

import base64
import binascii
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles_engine.errors import SandboxError

EXEC_ROOT = "/tmp/.miles-exec"  # per-exec dirs; removed by the next exec (the sandbox dies with the rest)
STAGING_ROOT = "/tmp/.miles-stage"  # files in transit between the host and the sandbox
REPLY_MAGIC = "MILES-EXEC-V1"
_SEP = "MILES-SEP"  # '-' is outside the base64 alphabet, so these markers cannot occur in a payload
_END = "MILES-END"
ENV_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


@dataclass(frozen=True)
class ExecReply:
    exit_code: int | None  # None when the wrapper killed the command on timeout
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_size: int  # full size the command wrote (may exceed len(stdout))
    stderr_size: int

    @property
    def truncated(self) -> bool:
        return self.stdout_size > len(self.stdout) or self.stderr_size > len(self.stderr)


def q(word: str) -> str:
    return shlex.quote(word)


def check_env_names(env: Mapping[str, str]) -> None:
    for name in env:
        if not name or name[0].isdigit() or not set(name) <= ENV_NAME_CHARS:
            raise ValueError(f"invalid environment variable name {name!r}: use letters, digits and '_'")


def command_argv(cmd: str | Sequence[str]) -> list[str]:
    """The protocol's rule: a string runs under ``bash -c``, a list runs as argv."""
    if isinstance(cmd, str):
        return ["bash", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv:
        raise SandboxError("exec needs a command: got an empty argument list")
    return argv


# The wrapper. Positional parameters: $1 exec dir, $2 cwd, $3 timeout (s), $4 kill grace (s),
# $5 output cap (bytes), $6 stdin file ('' for /dev/null), then what `env` runs: NAME=VALUE
# words followed by `sh -c CD_EXEC sh CWD ARGV...`.
_WRAPPER = r"""
d=$1; t=$3; g=$4; cap=$5; in=${6:-/dev/null}; shift 6
rm -rf -- "$d"; mkdir -p -- "$d" || { echo "miles: cannot create $d" >&2; exit 97; }
exec 2>"$d/wrapper.err"  # the shell's own job notices ("Killed") stay out of the reply
ss=; command -v setsid >/dev/null 2>&1 && ss=setsid
# an asynchronous command of a shell without job control starts with SIGINT and SIGQUIT
# ignored, and an ignored signal survives exec: env --default-signal (coreutils >= 8.31)
# gives the command default dispositions where the image's env has it
ds=; env --default-signal true 2>/dev/null && ds=--default-signal
# env NAME=VALUE... sh -c 'cd; exec argv': the command's own process, leader of its own session
$ss env $ds "$@" <"$in" >"$d/out" 2>"$d/err" &
pid=$!
(
  trap 'kill $s 2>/dev/null; exit 0' TERM
  sleep "$t" & s=$!; wait $s || exit 0
  : >"$d/timeout"
  kill -TERM -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null
  sleep "$g" & s=$!; wait $s
  kill -KILL -$pid 2>/dev/null || kill -KILL $pid 2>/dev/null
) >/dev/null 2>&1 &
w=$!
wait $pid; rc=$?
to=0; [ -e "$d/timeout" ] && { to=1; kill -KILL -$pid 2>/dev/null; }
kill $w 2>/dev/null
osz=$(wc -c <"$d/out"); esz=$(wc -c <"$d/err")
head -c "$cap" <"$d/out" >"$d/out.cap"; head -c "$cap" <"$d/err" >"$d/err.cap"
echo "$rc $to" $osz $esz >"$d/status.tmp" && mv -f "$d/status.tmp" "$d/status"
echo "MILES-EXEC-V1 $rc $to" $osz $esz
base64 <"$d/out.cap"; echo MILES-SEP
base64 <"$d/err.cap"; echo MILES-END
"""
# The command part run under `env`: cd to the cwd (a missing cwd is the command's own failure,
# as in a shell), then exec the argv.
_CD_EXEC = 'cd -- "$1" || exit 1; shift; exec "$@"'


def exec_script(
    exec_dir: str,
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    timeout_s: float,
    grace_s: float,
    cap: int,
    stdin_path: str | None,
    cleanup: Sequence[str] = (),
) -> str:
    """The ``sh`` script one remote exec sends (``sh -c SCRIPT``-ready, already quoted)."""
    check_env_names(env)
    words = [f"{k}={v}" for k, v in env.items()]
    args = [
        exec_dir,
        cwd,
        f"{timeout_s:.3f}",
        f"{grace_s:.3f}",
        str(cap),
        stdin_path or "",
        *words,
        "sh",
        "-c",
        _CD_EXEC,
        "sh",
        cwd,
        *argv,
    ]
    prelude = f"rm -rf -- {' '.join(q(p) for p in cleanup)} 2>/dev/null\n" if cleanup else ""
    body = "set -- " + " ".join(q(a) for a in args) + "\n" + _WRAPPER
    return prelude + body


def parse_reply(text: str, *, what: str = "exec") -> ExecReply:
    """Decode the wrapper's framed reply; :class:`SandboxError` when it is not one (the image
    lacks ``sh``/``base64``/``setsid``-era coreutils, or the transport mangled it)."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(REPLY_MAGIC + " "))
        sep = lines.index(_SEP, start)
        end = lines.index(_END, sep)
        head = lines[start].split()
        rc, to, osz, esz = int(head[1]), head[2] == "1", int(head[3]), int(head[4])
        out = base64.b64decode("".join(lines[start + 1 : sep]), validate=True)
        err = base64.b64decode("".join(lines[sep + 1 : end]), validate=True)
    except (StopIteration, ValueError, IndexError, binascii.Error):
        tail = text.strip()[-300:] or "(no output)"
        raise SandboxError(
            f"{what}: the sandbox's reply is not the exec wrapper's framed output (the image needs "
            f"sh, base64, head and wc): {tail}"
        ) from None
    return ExecReply(None if to else rc, to, out, err, osz, esz)


def parse_status(text: str) -> tuple[int, bool, int, int]:
    rc, to, osz, esz = text.split()
    return int(rc), to == "1", int(osz), int(esz)
