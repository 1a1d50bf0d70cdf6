"""Weight-sync routes of the SGLang-compatible engine server (added by ``create_app``):

- ``POST /init_weights_update_group`` and ``POST /update_weights_from_distributed``,
  ``POST /destroy_weights_update_group``: names and fields as SGLang's; answers
  ``{"success", "message"}`` (400 with ``success: false`` when refused).
- ``GET|POST /get_weights_by_name``: SGLang's debugging route, ``{"name", "truncate_size": 100}``
  -> the tensor's first ``truncate_size`` rows as nested float32 lists (400 on an unknown name).
- ``POST /miles/weight_checksums`` (ours): ``{"names": [...]}`` (optional) ->
  ``{"checksums": {name: sha256}, "weight_version"}``, to verify a push tensor by tensor.
- ``POST /miles/lora_base`` (ours): ``{"names": [...]}`` -> ``{"digests": {name: sha256}}``: the
  engine keeps the loaded base of each weight for adapter-only pushes (digests of the float32 base).

Imports no torch until a route is called.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from miles_engine.engines.http.wire import error_body
from miles_engine.engines.protocol import served_tensors
from miles_engine.errors import MilesError, did_you_mean
from miles_engine.weights.receiver import DistributedReceiver, ReceiveError

log = logging.getLogger(__name__)


def _refused(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": msg,
                         **error_body(msg, "BadRequestError" if status < 500 else "InternalServerError")},
                        status_code=status)


def _rows_as_float32(t: Any, truncate_size: int) -> Any:
    """SGLang's answer: the first ``truncate_size`` rows, as float32 nested lists."""
    import torch

    t = t.detach().to("cpu")
    if t.dim():
        t = t[:truncate_size]
    return t.to(torch.float32).tolist()


def add_weight_sync_routes(app: FastAPI, engine: Any, *, update_lock: asyncio.Lock,
                           parse: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    receiver = DistributedReceiver(engine, update_lock=update_lock)

    async def _guard(call: Callable[[], Awaitable[str]], what: str) -> JSONResponse:
        try:
            message = await call()
        except (ReceiveError, MilesError, ValueError) as exc:
            return _refused(f"{what} refused: {exc}")
        except Exception as exc:  # noqa: BLE001 - the server keeps serving
            log.exception("%s failed", what)
            return _refused(f"{what} failed: {type(exc).__name__}: {exc}", 500)
        return JSONResponse({"success": True, "message": message})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await parse(request)
        return await _guard(lambda: receiver.init_group(body), "init_weights_update_group")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await parse(request)

        async def run() -> str:
            return (await receiver.update(body))[0]

        return await _guard(run, "update_weights_from_distributed")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await parse(request)

        async def run() -> str:
            return receiver.destroy_group(str(body.get("group_name", "weight_update_group")))

        return await _guard(run, "destroy_weights_update_group")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        body = await parse(request)
        model = getattr(engine, "model", None)
        if model is None:
            return _refused(f"{type(engine).__name__} does not expose its tensors; get_weights_by_name needs an "
                            f"embedded engine")
        name, truncate = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not name:
            return _refused("get_weights_by_name needs a tensor name (string field 'name')")
        if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 1:
            return _refused(f"truncate_size must be a positive integer, got {truncate!r}")
        async with update_lock:  # never read a half-copied update
            tensors = served_tensors(engine, [name]) or {}
            if name not in tensors:
                known = served_tensors(engine) or {}
                return _refused(f"Get parameter by name failed: no tensor {name!r}{did_you_mean(name, known)}")
            value = await asyncio.to_thread(_rows_as_float32, tensors[name], truncate)
        # NaN / Infinity kept as Python's json writes them (SGLang's orjson would send null)
        return Response(json.dumps(value, allow_nan=True, separators=(",", ":")), media_type="application/json")

    @app.post("/miles/weight_checksums")
    async def weight_checksums(request: Request) -> JSONResponse:
        body = await parse(request)
        model = getattr(engine, "model", None)
        if model is None:
            return _refused(f"{type(engine).__name__} does not expose its tensors; checksums need an embedded engine")
        names = body.get("names")
        from miles_engine.weights.tensors import digests

        async with update_lock:  # never read a half-copied update
            sums = await asyncio.to_thread(digests, served_tensors(engine, names) or {}, names)
        return JSONResponse({"checksums": sums, "weight_version": str(engine.weight_version)})

    @app.post("/miles/lora_base")
    async def lora_base(request: Request) -> JSONResponse:
        body = await parse(request)
        keep = getattr(engine, "keep_lora_base", None)
        if keep is None:
            return _refused(f"{type(engine).__name__} cannot keep base weights; adapter pushes need an embedded engine")
        names = body.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return _refused(f"lora_base needs 'names', a list of tensor names; got {names!r}")
        async with update_lock:
            try:
                digests = await keep(names)
            except MilesError as exc:
                return _refused(f"lora_base refused: {exc}")
        return JSONResponse({"digests": digests})
