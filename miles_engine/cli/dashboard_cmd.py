"""``miles dashboard RUN_DIR...``: a read-only local web page over one or more runs."""

from __future__ import annotations

import errno
import ipaddress
import socket
from pathlib import Path

import click

from miles_engine.dashboard.data import NotARunError, check_run_dir

DEFAULT_PORT = 8765


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: any free port), or one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left by a previous dashboard is fine
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(f"port {port} on {host} is already in use; choose another with --port P, "
                                       "or --port 0 for any free port") from None
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@click.command("dashboard")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--follow", is_flag=True, help="Keep reading the runs as they grow; the overview updates every ~2 s.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback by default: only this machine can read the page).")
def dashboard(run_dirs: tuple[Path, ...], follow: bool, port: int, host: str) -> None:
    """Serve a read-only web page over RUN_DIR(s): curves (runs overlaid), each step's groups,
    trajectories token by token with the conversation and sandbox commands, evaluations."""
    try:
        for path in run_dirs:
            check_run_dir(path)
    except NotARunError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        import uvicorn

        from miles_engine.dashboard.app import create_app
    except ImportError as exc:
        raise click.ClickException(f"the dashboard needs the server extra ({exc.name} is missing): "
                                   "pip install 'miles-engine[server]'") from None
    sock = bind(host, port)  # first: a port in use is reported before a big run is read
    try:
        app = create_app(list(run_dirs), follow=follow)
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    if not _is_loopback(host):
        click.echo(f"note: listening on {host}: anyone who can reach it can read these runs", err=True)
    click.echo(f"dashboard: http://{shown}:{bound}/  ({len(run_dirs)} run(s){', following' if follow else ''}; "
               "Ctrl-C stops it)", nl=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
