"""Launch a real SGLang server (``python -m sglang.launch_server``) and talk to it with the
same :class:`HttpEngine` that talks to our embedded server.

``sglang`` is an optional extra CI never installs (it pins a CUDA torch); this module only
builds a command line and manages a subprocess, so it imports without it. Flag names follow
SGLang's ``srt/server_args.py`` (``--tp-size``/``--dp-size``/``--ep-size`` aliases,
``--mem-fraction-static``, ``--speculative-*``, ``--weight-version``).

Packaging (to add to pyproject by hand; never installed by CI):
``[project.optional-dependencies] sglang = ["sglang>=0.5"]``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.launch import ServerProcess, free_port
from miles_engine.engines.sglang_options import SGLangSpeculativeOptions, speculative_options

@dataclass
class SGLangLaunchConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free port
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    dtype: str | None = None  # "auto" | "bfloat16" | "float16" | ...
    mem_fraction_static: float | None = None
    speculative: SGLangSpeculativeOptions | Mapping[str, Any] | None = None
    weight_version: int | None = 0  # our versions are ints; SGLang's default is "default"
    extra_args: Sequence[str] = ()  # passed through verbatim, last (so they can override)
    python: str = sys.executable
    env: Mapping[str, str] | None = None
    start_timeout_s: float = 900.0
    log_path: str | Path | None = None


def build_command(cfg: SGLangLaunchConfig, port: int) -> list[str]:
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", str(cfg.model_path),
           "--host", cfg.host, "--port", str(port)]
    for flag, value in (("--tp-size", cfg.tp_size), ("--dp-size", cfg.dp_size), ("--ep-size", cfg.ep_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
        if value != 1:
            cmd += [flag, str(value)]
    if cfg.dtype:
        cmd += ["--dtype", cfg.dtype]
    if cfg.mem_fraction_static is not None:
        if not 0.0 < cfg.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {cfg.mem_fraction_static}")
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    spec = speculative_options(cfg.speculative)
    if spec is not None:
        cmd += spec.flags()
    if any(str(a).startswith("--speculative") for a in cfg.extra_args):
        raise ValueError("speculative decoding is set with speculative (typed, checked), not with --speculative-* "
                         "flags in extra_args")
    if cfg.weight_version is not None:
        cmd += ["--weight-version", str(cfg.weight_version)]
    cmd += [str(a) for a in cfg.extra_args]
    return cmd


class SGLangServer:
    """``async with SGLangServer(cfg) as engine:`` starts the server, yields a connected
    :class:`HttpEngine`, and stops the whole process group on exit."""

    def __init__(self, cfg: SGLangLaunchConfig, **client_kwargs: Any) -> None:
        self.cfg = cfg
        self.port = cfg.port or free_port(cfg.host)
        self.command = build_command(cfg, self.port)
        self.process = ServerProcess(self.command, host=cfg.host, port=self.port, env=cfg.env,
                                     log_path=cfg.log_path, name=f"sglang:{self.port}")
        self.client_kwargs = client_kwargs
        self.engine: HttpEngine | None = None

    @property
    def url(self) -> str:
        return self.process.url

    async def start(self) -> HttpEngine:
        await self.process.start(self.cfg.start_timeout_s)
        self.engine = HttpEngine(self.url, **{"name": self.process.name, **self.client_kwargs})
        try:
            await self.engine.connect()
        except Exception:
            await self.stop()
            raise
        return self.engine

    async def stop(self, grace_s: float = 30.0) -> int | None:
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None
        return await self.process.stop(grace_s)

    async def __aenter__(self) -> HttpEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
