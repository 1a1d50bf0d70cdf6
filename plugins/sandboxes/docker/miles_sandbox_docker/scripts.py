"""The POSIX shell scripts run inside containers (they need only /bin/sh and /proc).

``EXEC_WRAPPER`` starts every command: it prints :data:`START_MARK` (so output that lacks it
means docker never started the command, a sandbox failure rather than a command failure),
changes to the working directory, then ``exec``s the command. A string command runs under
bash when the image has it, else sh.

Every exec carries ``MILES_EXEC=<token>`` in its environment. On timeout ``KILL_TREE``
(run as root) finds the processes carrying the token, freezes them, adds their descendants
until no new one appears (children that scrubbed their environment are still caught through
their parent), then SIGKILLs the whole set. It forks one ``grep`` and otherwise uses shell
builtins, so it is cheap however many processes the container holds.
"""

from __future__ import annotations

EXEC_ENV = "MILES_EXEC"
START_MARK = b"\x1emiles-exec\x1e\n"

EXEC_WRAPPER = r"""printf '\036miles-exec\036\n'
cd -- "$1" || exit 125
if [ "$2" = --shell ]; then
  if command -v bash >/dev/null 2>&1; then exec bash -c "$3"; fi
  exec sh -c "$3"
fi
shift 2
exec "$@"
"""

KILL_TREE = r"""all=" "
for f in $(grep -lsF -- "MILES_EXEC=$1" /proc/[0-9]*/environ); do
  p=${f#/proc/}; p=${p%/environ}
  [ "$p" = "$$" ] || all="$all$p "
done
[ "$all" = " " ] && exit 0
kill -STOP $all 2>/dev/null
i=0
while [ $i -lt 50 ]; do
  i=$((i + 1)); added=""
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case "$all" in *" $p "*) continue ;; esac
    read -r s < "$d/stat" 2>/dev/null || continue
    s=${s##*) }
    set -- $s
    case "$all" in *" $2 "*) added="$added $p" ;; esac
  done
  [ -z "$added" ] && break
  kill -STOP $added 2>/dev/null
  all="$all${added# } "
done
kill -KILL $all 2>/dev/null
exit 0
"""

SETUP = r"""set -e
for d in "$@"; do mkdir -p -- "$d"; done
"""

# The container's main process: idles (or lives ttl seconds), exits on SIGTERM.
KEEPALIVE = r"""trap 'exit 0' TERM INT
if [ -n "$1" ]; then sleep "$1" & wait $!; exit 0; fi
while :; do sleep 3600 & wait $!; done
"""
