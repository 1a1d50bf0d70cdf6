"""``python launch.py --port-file FILE [--port N] <vLLM server args>``: vLLM's OpenAI server on
127.0.0.1 at port N (the first non-zero ``--port``; none or 0: a free one), the port written to FILE
first (atomically), then the server runs in this process. A free port is probed just before; another
process taking it in between makes the server fail to bind, which the supervisor sees as a failed
start and retries."""

from __future__ import annotations

import os
import runpy
import socket
import sys


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> None:
    port_file, port, rest = None, 0, []
    it = iter(argv)
    for arg in it:
        if arg == "--port-file":
            port_file = next(it)
        elif arg == "--port":
            value = int(next(it))
            port = port or value
        else:
            rest.append(arg)
    if port_file is None:
        sys.exit("launch.py: --port-file is required")
    host = "127.0.0.1"
    port = port or _free_port(host)
    tmp = f"{port_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, port_file)
    sys.argv = ["vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port), *rest]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
