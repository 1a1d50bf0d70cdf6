"""A fake ``docker`` CLI: the exact subcommands, flags, output formats, exit codes and error
texts the backend relies on, over a state directory (``$FAKE_DOCKER_STATE``) instead of an engine.

Containers are real: a container is a root directory, its main process and every
``docker exec`` run under bubblewrap with that directory as ``/`` and the host's /usr and
/etc read-only (no pid namespace, so the backend's in-container kill script is exercised for
real). Not emulated: users (everything runs as the caller), resource limits, image contents
(an image is only a name; ``build`` checks the Dockerfile's shape and ``RUN false`` fails).

Faults are injected through ``faults.json`` in the state dir:
``{"down": true}`` (no engine), ``{"hang": ["cp"]}`` (that subcommand never answers),
``{"fail": {"cp": ["stderr text", ...]}}`` (the next calls of that subcommand fail with
these texts, one per call), ``{"lose": ["run"]}`` (the next call of that subcommand does its
work but its answer is lost: a connection-reset error) and ``registry.json`` maps image refs to ``ok``/``denied``/
``ratelimit`` (others: manifest unknown).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_DOCKER_STATE"])
UNREACHABLE = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
MARK_ENV = "FAKE_DOCKER_CONTAINER"
VALUE_FLAGS = {
    "run": {"--pull", "--name", "--label", "--network", "--hostname", "--cpus", "--memory", "--memory-swap",
            "--storage-opt", "--gpus", "--pids-limit", "--ulimit", "--env", "--user", "--workdir", "--entrypoint"},
    "exec": {"-e", "-u", "-w"},
    "ps": {"--filter", "--format"},
    "build": {"--tag", "--file", "--label", "--network"},
    "image inspect": {"--format"}, "container inspect": {"--format"}, "version": {"--format"},
}
BOOLS = {"run": {"--detach", "--init", "--rm"}, "exec": {"-i"}, "ps": {"--all", "--no-trunc"},
         "rm": {"--force", "--volumes"}, "pull": {"--quiet"}, "build": {"--quiet", "--force-rm"}, "cp": {"-L"}}


def fail(msg: str, rc: int = 1) -> None:
    sys.stderr.write(msg + "\n")
    sys.exit(rc)


def load(name: str, default):
    p = STATE / name
    return json.loads(p.read_text()) if p.exists() else default


def save(name: str, data) -> None:
    tmp = STATE / f".{name}.{os.getpid()}"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, STATE / name)


class Lock:
    def __enter__(self):
        self.fd = os.open(STATE / ".lock", os.O_CREAT | os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)


def parse(cmd: str, argv: list[str], stop_at_positional: bool = False):
    flags: dict[str, list[str]] = {}
    pos: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if pos and stop_at_positional:
            pos.append(a)
        elif a == "-":
            pos.append(a)
        elif a.startswith("-"):
            if a in BOOLS.get(cmd, set()):
                flags.setdefault(a, []).append("")
            elif a in VALUE_FLAGS.get(cmd, set()):
                i += 1
                flags.setdefault(a, []).append(argv[i])
            else:
                fail(f"unknown flag: {a}\nSee 'docker {cmd} --help'.", 125)
        else:
            pos.append(a)
        i += 1
    return flags, pos


# ------------------------------------------------------------------------------ containers
def containers() -> dict[str, dict]:
    """Live containers; a --rm container whose main process ended is removed (as dockerd does)."""
    found = {}
    for meta in (STATE / "containers").glob("*/meta.json"):
        c = json.loads(meta.read_text())
        if not pid_alive(c["pid"]) and c["rm"]:
            remove(c)
            continue
        found[c["id"]] = c
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def find(ref: str) -> dict:
    for c in containers().values():
        if ref in (c["id"], c["name"]) or (len(ref) >= 4 and c["id"].startswith(ref)):
            return c
    fail(f"Error response from daemon: No such container: {ref}")
    raise AssertionError


def container_pids(cid: str) -> list[int]:
    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if f"{MARK_ENV}={cid}".encode() in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def remove(c: dict) -> None:
    for pid in container_pids(c["id"]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(STATE / "containers" / c["id"], ignore_errors=True)


def bwrap(c: dict, argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
    root = STATE / "containers" / c["id"] / "rootfs"
    cmd = ["bwrap", "--bind", str(root), "/", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for top in ("bin", "sbin", "lib", "lib64", "lib32"):
        host = Path("/") / top
        if host.is_symlink():
            if not (root / top).is_symlink():  # bwrap leaves it in the writable root: once is enough
                cmd += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            cmd += ["--ro-bind", str(host), f"/{top}"]
    cmd += ["--bind", "/proc", "/proc", "--dev", "/dev", "--chdir", cwd, "--clearenv"]
    if c["network"] == "none":
        cmd.append("--unshare-net")
    for k, v in {**env, MARK_ENV: c["id"]}.items():
        cmd += ["--setenv", k, v]
    return cmd + ["--", *argv]


def base_env(c: dict) -> dict[str, str]:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME": c["hostname"], "HOME": "/root"}
    env.update(kv.split("=", 1) for kv in c["env"])
    return env


def cmd_run(argv: list[str]) -> None:
    flags, pos = parse("run", argv, stop_at_positional=True)
    image, args = pos[0], pos[1:]
    if image not in load("images.json", []):
        fail(f"Unable to find image '{image}' locally\ndocker: Error response from daemon: No such image: {image}", 125)
    name = flags["--name"][0]
    with Lock():
        for c in containers().values():
            if c["name"] == name:
                fail(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use by '
                     f'container "{c["id"]}". You have to remove (or rename) that container to be able to reuse that name.', 125)
        cid = secrets.token_hex(32)
        root = STATE / "containers" / cid / "rootfs"
        workdir = flags.get("--workdir", ["/"])[0]
        for d in ("tmp", "root", workdir.lstrip("/")):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        c = {"id": cid, "name": name, "image": image, "workdir": workdir, "rm": "--rm" in flags,
             "labels": dict(kv.split("=", 1) for kv in flags.get("--label", [])),
             "network": flags.get("--network", ["bridge"])[0], "env": flags.get("--env", []),
             "hostname": flags.get("--hostname", [cid[:12]])[0], "pid": 0}
        entry = flags.get("--entrypoint", [])
        err_path = STATE / "containers" / cid / "main.err"
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(bwrap(c, entry + args, base_env(c), workdir), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        # as dockerd, answer once the container's process runs (bwrap may fail to set it up)
        deadline = time.monotonic() + 60
        while not container_pids(cid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        setup_error = err_path.read_text(errors="replace").strip() if proc.poll() is not None else ""
        if setup_error.startswith("bwrap:"):  # the container never ran (not: its program ran and exited)
            shutil.rmtree(STATE / "containers" / cid, ignore_errors=True)
            fail(f"docker: Error response from daemon: failed to create task for container {cid[:12]}: "
                 f"{setup_error}", 125)
        c["pid"] = proc.pid
        (STATE / "containers" / cid / "meta.json").write_text(json.dumps(c))
    print(cid)


def cmd_exec(argv: list[str]) -> None:
    flags, pos = parse("exec", argv, stop_at_positional=True)
    c = find(pos[0])
    if not pid_alive(c["pid"]):
        fail(f"Error response from daemon: container {c['id']} is not running")
    env = base_env(c)
    env.update(kv.split("=", 1) for kv in flags.get("-e", []))
    if not shutil.which(pos[1], path=env["PATH"]) and not pos[1].startswith("/"):
        fail(f'OCI runtime exec failed: exec failed: unable to start container process: exec: "{pos[1]}": '
             f"executable file not found in $PATH: unknown", 126)
    if "-i" not in flags:  # stdin is attached only with -i
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
    for signum in (signal.SIGPIPE, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)  # as runc starts it, whatever this CLI inherited
    os.execvp("bwrap", bwrap(c, pos[1:], env, flags.get("-w", [c["workdir"]])[0]))


def inside(root: Path, path: str) -> Path:
    p = Path(os.path.normpath(str(root) + "/" + path.lstrip("/")))
    if p != root and not str(p).startswith(str(root) + "/"):
        fail(f"Error response from daemon: invalid path {path}")
    return p


def cmd_cp(argv: list[str]) -> None:
    flags, (src, dst) = parse("cp", argv)
    if src == "-":
        ref, _, dest = dst.partition(":")
        # The real CLI stats the destination first and ignores a failed stat (no container,
        # no such path): what the user then sees is this, not "No such container".
        c = next((c for c in containers().values() if ref in (c["id"], c["name"])), None)
        root = STATE / "containers" / (c["id"] if c else "-") / "rootfs"
        if c is None or not inside(root, dest).is_dir():
            fail(f'destination "{ref}:{dest}" must be a directory')
        target = inside(root, dest)
        with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r") as tar:
            for m in tar.getmembers():
                out = inside(root, dest + "/" + m.name)
                out.parent.mkdir(parents=True, exist_ok=True)  # the engine creates missing parents
                if m.isdir():
                    out.mkdir(exist_ok=True)
                    out.chmod(m.mode & 0o7777)
                elif m.isfile():
                    out.write_bytes(tar.extractfile(m).read())
                    out.chmod(m.mode & 0o7777)
                elif m.issym():
                    out.unlink(missing_ok=True)
                    out.symlink_to(m.linkname)
        return
    ref, _, path = src.partition(":")
    c = find(ref)
    root = STATE / "containers" / c["id"] / "rootfs"
    p = inside(root, path)
    if "-L" in flags and p.is_symlink():
        target = os.readlink(p)
        p = inside(root, target if target.startswith("/") else str(Path(path).parent / target))
    if not p.exists():
        fail(f"Error response from daemon: Could not find the file {path} in container {ref}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(p, arcname=os.path.basename(path.rstrip("/")) or "/")
    sys.stdout.buffer.write(buf.getvalue())


def cmd_rm(argv: list[str]) -> None:
    _, refs = parse("rm", argv)
    missing = []
    with Lock():
        for ref in refs:
            c = next((c for c in containers().values() if ref in (c["id"], c["name"])), None)
            if c is None:
                missing.append(ref)
                continue
            remove(c)
            print(ref)
    if missing:
        fail("\n".join(f"Error response from daemon: No such container: {r}" for r in missing))


def template(fmt: str, c: dict) -> str:
    def sub(m: re.Match) -> str:
        expr = m.group(1).strip()
        if expr == ".ID":
            return c["id"]
        if expr == ".State.Running":
            return "true" if pid_alive(c["pid"]) else "false"
        if expr == "json .Config.Labels":
            return json.dumps(c["labels"])
        lab = re.fullmatch(r'(?:\.Label|index \.Config\.Labels) "([^"]+)"', expr)
        if lab:
            return c["labels"].get(lab.group(1), "")
        fail(f"template: unsupported expression {expr!r} (fake docker)", 125)
        raise AssertionError

    return re.sub(r"\{\{(.*?)\}\}", sub, fmt.replace("\\t", "\t"))


def cmd_ps(argv: list[str]) -> None:
    flags, _ = parse("ps", argv)
    wanted = [f.removeprefix("label=").split("=", 1) for f in flags.get("--filter", [])]
    for c in containers().values():
        if all(c["labels"].get(k) == v for k, v in wanted):
            print(template(flags["--format"][0], c))


def cmd_inspect(kind: str, argv: list[str]) -> None:
    flags, (ref,) = parse(f"{kind} inspect", argv)
    if kind == "image":
        if ref not in load("images.json", []):
            fail(f"Error response from daemon: No such image: {ref}")
        print("sha256:" + hashlib.sha256(ref.encode()).hexdigest())
        return
    print(template(flags["--format"][0], find(ref)))


def add_image(ref: str) -> None:
    with Lock():
        save("images.json", sorted(set(load("images.json", [])) | {ref}))


def cmd_pull(argv: list[str]) -> None:
    _, (ref,) = parse("pull", argv)
    verdict = load("registry.json", {}).get(ref)
    if verdict == "denied":
        fail(f"Error response from daemon: pull access denied for {ref}, repository does not exist or may require "
             f"'docker login': denied: requested access to the resource is denied")
    if verdict == "ratelimit":
        fail("Error response from daemon: toomanyrequests: You have reached your pull rate limit. You may increase "
             "the limit by authenticating and upgrading: https://www.docker.com/increase-rate-limit")
    if verdict != "ok":
        fail(f"Error response from daemon: manifest for {ref} not found: manifest unknown: manifest unknown")
    add_image(ref)
    print(f"docker.io/library/{ref}")


def cmd_build(argv: list[str]) -> None:
    flags, (ctx,) = parse("build", argv)
    dockerfile = Path(flags["--file"][0])
    lines = [ln.strip() for ln in dockerfile.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if not lines or not lines[0].upper().startswith("FROM "):
        fail("ERROR: failed to build: failed to solve: dockerfile parse error: no FROM instruction", 1)
    if "RUN false" in lines:
        fail('ERROR: failed to build: failed to solve: process "/bin/sh -c false" did not complete successfully: exit code: 1')
    add_image(flags["--tag"][0])
    print("sha256:" + hashlib.sha256(flags["--tag"][0].encode()).hexdigest())


def main(argv: list[str]) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "containers").mkdir(exist_ok=True)
    with open(STATE / "calls.log", "a") as log:
        log.write(json.dumps(argv) + "\n")
    sub = argv[0] if argv[0] not in ("image", "container") else f"{argv[0]} {argv[1]}"
    rest = argv[len(sub.split()):]
    faults = load("faults.json", {})
    name = sub
    if faults.get("down"):
        fail(UNREACHABLE)
    if name in faults.get("hang", []):
        time.sleep(3600)
    with Lock():
        faults = load("faults.json", {})
        queue = faults.get("fail", {}).get(name, [])
        if queue:
            msg = queue.pop(0)
            save("faults.json", faults)
            fail(msg)
    with Lock():
        faults = load("faults.json", {})
        lose = name in faults.get("lose", [])
        if lose:
            faults["lose"].remove(name)
            save("faults.json", faults)
    if lose:
        sys.stdout = open(os.devnull, "w")
        handlers_for_lost = {"run": cmd_run, "rm": cmd_rm}
        handlers_for_lost[name](rest)
        fail("Error response from daemon: read unix @->/var/run/docker.sock: read: connection reset by peer")
    if sub == "version":
        print("28.2.2-fake")
        return
    handlers = {"run": cmd_run, "exec": cmd_exec, "cp": cmd_cp, "rm": cmd_rm, "ps": cmd_ps, "pull": cmd_pull,
                "build": cmd_build, "image inspect": lambda a: cmd_inspect("image", a),
                "container inspect": lambda a: cmd_inspect("container", a)}
    if sub not in handlers:
        fail(f"docker: unknown command: docker {sub} (fake docker)", 125)
    handlers[sub](rest)


if __name__ == "__main__":
    main(sys.argv[1:])
