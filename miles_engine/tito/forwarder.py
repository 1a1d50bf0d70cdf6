"""A route from inside a sandbox to the session server, without opening the host network.

Host side (:class:`UnixForwarder`): a Unix socket in a directory the sandbox has mapped (its
``/tmp``), relaying every connection byte for byte to the session server's TCP port.
Sandbox side (:data:`RELAY`): a stdlib Python relay listening on ``127.0.0.1:<ephemeral>``
inside the sandbox's own network namespace and relaying to that socket; it writes its port
to a file (``-``: prints ``port N`` on stdout). The local backend starts it next to the
harness; the docker backend in a forwarder container sharing the sandbox's network namespace
(``miles_sandbox_docker.route``). The sandbox keeps no other route out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

SANDBOX_DIR = "/tmp/.miles-tito"  # inside the sandbox: the socket and the relay's port file
SOCKET_NAME = "tito.sock"

RELAY = r"""
import os, socket, sys, threading
sock_path, port_file = sys.argv[1], sys.argv[2]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(64)
if port_file == "-":
    print("port", srv.getsockname()[1], flush=True)
else:
    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)

def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

def serve(client):
    upstream = socket.socket(socket.AF_UNIX)
    try:
        upstream.connect(sock_path)
    except OSError:
        client.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
    back.start()
    pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()

while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


class UnixForwarder:
    """Relay connections on a Unix socket at ``path`` to ``host:port`` (the session server)."""

    def __init__(self, path: str, host: str, port: int) -> None:
        self.path, self.host, self.port = path, host, port
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        os.chmod(os.path.dirname(self.path), 0o755)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._handle, path=self.path)
        os.chmod(self.path, 0o777)  # the sandbox may run under its own uid

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            self._conns.discard(task)
            return
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
            self._conns.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
