"""The built-in engine kinds, registered like a third party's."""

from __future__ import annotations

from typing import Any

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.engines.fleet import config
from miles_engine.engines.fleet.embedded import EmbeddedKind
from miles_engine.engines.fleet.external import ExternalKind
from miles_engine.engines.fleet.server import ServerKind
from miles_engine.engines.fleet.sglang_kind import SGLangKind
from miles_engine.engines.fleet.vllm_kind import VllmKind
from miles_engine.engines.vllm.options import VllmKindOptions


def _embedded(options: config.EmbeddedKindOptions) -> Any:
    return EmbeddedKind(options)


def _server(options: config.ServerKindOptions) -> Any:
    return ServerKind(options)


def _sglang(options: config.SGLangKindOptions) -> Any:
    return SGLangKind(options)


def _vllm(options: VllmKindOptions) -> Any:
    return VllmKind(options)


def _external(options: config.ExternalKindOptions) -> Any:
    return ExternalKind(options)


@hookimpl
def miles_register_engines() -> list[Component]:
    return [
        Component("embedded", _embedded, config.EmbeddedKindOptions,
                  "PyTorch engine in the driver process (CPU or GPU); colocated or disk_delta weights"),
        Component("server", _server, config.ServerKindOptions,
                  "`miles serve` engine processes launched and supervised by the run (loopback)"),
        Component("sglang", _sglang, config.SGLangKindOptions,
                  "SGLang servers launched by the run (GPU machines; the sglang extra)"),
        Component("vllm", _vllm, VllmKindOptions,
                  "vLLM servers launched by the run from vLLM's own environment (loopback; ./dev.sh vllm)"),
        Component("external", _external, config.ExternalKindOptions,
                  "SGLang-compatible servers at URLs someone else runs (never launched or killed)"),
    ]
