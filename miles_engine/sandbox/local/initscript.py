"""PID 1 of every sandbox namespace: the bash program (``INIT_SCRIPT``) and the request
encoding it reads. The host side is :mod:`miles_engine.sandbox.local.initexec`."""

from __future__ import annotations

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import process

READY = "miles-ready"
RESET_DONE = "miles-reset-done"
CTL_DIR = "/dev/.miles"  # inside the namespace; /dev is read-only, the FIFOs still open

# PID 1 runs with job control (set -m): every command it forks leads its own process group,
# which is what `kill` signals, without exec'ing setsid (~1 ms of CPU per command); job notices
# go to /dev/null with the rest of its stderr once it is ready. It reaps orphans (bash waits for
# any child on SIGCHLD) and ignores every signal sandboxed code may send it (the kernel drops
# SIGKILL from inside for PID 1); commands get the default dispositions back (an ignored signal
# survives exec: SIGPIPE and SIGTERM would stay ignored). It exits at EOF on stdin (when we
# close the pipe, or when this process dies). reset: kill -1 from PID 1 spares only itself;
# System V IPC objects are removed when any exist (builtins only, ipcrm if needed).
INIT_SCRIPT = r"""
trap '' INT TERM HUP QUIT USR1 USR2 PIPE ALRM
set -m
echo miles-ready
exec 2>/dev/null
f() { IFS= read -r -d '' "$1"; }
num() { [[ $1 =~ ^[0-9]{1,7}$ ]]; }
while f op; do
  case $op in
  reset)
    f nonce || break
    kill -KILL -1 2>/dev/null
    for q in /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg; do
      l=; { read -r _; read -r l; } < $q 2>/dev/null
      if [ -n "$l" ]; then ipcrm --all 2>/dev/null; break; fi
    done
    echo "miles-reset-done ${nonce//[^0-9a-f]/}";;
  kill)
    f sig && f pg || break
    [[ $sig =~ ^[A-Z]{1,6}$ ]] && num "$pg" && kill -s "$sig" -- "-$pg" 2>/dev/null;;
  run)
    f id && f cwd && f in && f out && f err && f lim && f n || break
    num "$n" || continue
    e=(); for ((i = 0; i < n; i++)); do f v; e+=("$v"); done
    f n || break
    num "$n" || continue
    a=(); for ((i = 0; i < n; i++)); do f v; a+=("$v"); done
    id=${id//[^0-9a-f]/}
    [[ $lim =~ ^[-a-zA-Z0-9\ ]*$ ]] || continue
    exec 4< "$in" 5> "$out" 6> "$err" || { exec 4<&- 5>&- 6>&-; echo "exit $id 126"; continue; }
    (
      trap - INT TERM HUP QUIT USR1 USR2 PIPE ALRM
      exec 0<&4 1>&5 2>&6 4<&- 5>&- 6>&-
      cd -- "$cwd" 2>/dev/null || { echo "cannot change directory to '$cwd': No such file or directory" >&2; exit 125; }
      ulimit $lim 2>/dev/null || exit 126
      unset PATH
      export -n PWD OLDPWD SHLVL
      export -- "${e[@]}"
      exec "${a[@]}"
    ) &
    echo "pid $id $!"
    exec 4<&- 5>&- 6>&-;;
  wait)
    f id && f pid || break
    num "$pid" && { wait "$pid" 2>/dev/null; echo "exit ${id//[^0-9a-f]/} $?"; };;
  esac
done
"""


def ulimit_args(limits: process.Limits) -> str:
    """``ulimit`` options (soft and hard) for ``limits``; bash units: KiB for -v and -f."""
    args = ["-c 0"]
    if limits.cpu_s:
        args.append(f"-t {limits.cpu_s}")
    if limits.address_space_bytes:
        args.append(f"-v {limits.address_space_bytes // 1024}")
    if limits.open_files:
        args.append(f"-n {limits.open_files}")
    if limits.file_size_bytes:
        args.append(f"-f {limits.file_size_bytes // 1024}")
    if limits.processes:
        args.append(f"-u {limits.processes}")
    return " ".join(args)


def encode_field(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    if b"\0" in data:
        raise SandboxError("a command, argument, path or environment value contains a NUL byte")
    return data + b"\0"
