"""SGLang-compatible HTTP server for any :class:`RolloutEngine`, running it in the same process.

Endpoints (names, request fields and response shapes as SGLang's
``srt/entrypoints/http_server.py``): ``POST /generate`` (also SGLang's prefill-only scoring call,
``max_new_tokens=0`` with input log-probs: :mod:`.scoring`), ``POST /v1/tokenize``, ``GET /health``, ``GET /health_generate``,
``POST /update_weights_from_disk``, ``POST /update_weights_from_tensor``, ``POST /pause_generation``
(``{"mode": "abort"|"retract"|"in_place"}``), ``POST /continue_generation``, ``POST /abort_request``
(``{"rid"}`` or ``{"abort_all": true}``), ``GET /get_weight_version``, ``GET /get_model_info``,
``GET /get_server_info``, ``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
``POST /destroy_weights_update_group`` (see :mod:`miles_engine.weights.endpoints`); plus
``GET /miles/weight_metadata``, ``POST /miles/weight_checksums`` and
``POST /update_weights_from_disk_delta`` (ours, not SGLang's: the engine pulls a disk_delta
version from a shared publish root, see :mod:`miles_engine.weights.disk_delta.engine_server`).

Session affinity key: body ``session_id`` (recent SGLang) or ``routing_key`` (SGLang), or the
``X-SMG-Routing-Key`` header that Miles' session server and sgl-model-gateway send.
Per-token weight versions: ``meta_info["weight_versions"]`` spans, exactly as recent SGLang.
Bad input → 400 ``{"error": {"message", "type"}}``; engine faults → 500; the server keeps serving.

The weight-sync routes are mounted by the process that serves the engine
(:mod:`miles_engine.run.engine_server`: ``python -m miles_engine.run.engine_server --model
PATH|CONFIG [--port P]``, or ``miles serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from miles_engine import __version__
from miles_engine.engines.errors import EngineUnavailable
from miles_engine.engines.http import scoring, tensors, wire
from miles_engine.engines.http.wire import BadRequest, error_body
from miles_engine.engines.protocol import (
    PAUSE_EFFECTS,
    PAUSE_MODES,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
)
from miles_engine.errors import MilesError
from miles_engine.fastapi_app import new_fastapi_app

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 20.0


def _err(status: int, msg: str, type_: str, /, **extra: Any) -> JSONResponse:
    return JSONResponse({**extra, **error_body(msg, type_)}, status_code=status)


def _classify(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, BadRequest):
        return 400, exc.type
    if isinstance(exc, EngineUnavailable):
        return 503, "ServiceUnavailable"
    if isinstance(exc, (ValueError, MilesError)):
        return 400, "BadRequestError"
    return 500, "InternalServerError"


async def _json(request: Request, required: bool = True) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise BadRequest("the request body is empty; send a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# A route group mounted by the program that serves the engine: (app, engine, the lock every weight
# update holds, the JSON body parser). The engine server process mounts the weight-sync ones.
RouteGroup = Callable[[FastAPI, RolloutEngine, asyncio.Lock, Callable[[Request], Awaitable[dict[str, Any]]]], Any]


def create_app(engine: RolloutEngine, *, model_path: str | None = None, close_engine: bool = True,
               tokenizer: Any = None, otel: bool = False, routes: Sequence[RouteGroup] = ()) -> FastAPI:
    """A FastAPI app serving ``engine``; ``close_engine`` closes it on app shutdown. ``tokenizer``
    (default: ``tokenizer.json`` in the model directory) serves ``/v1/tokenize``. ``otel``: FastAPI's
    native OpenTelemetry instrumentation (see :func:`miles_engine.fastapi_app.new_fastapi_app`).
    ``routes``: more route groups (:func:`miles_engine.run.engine_server.create_engine_app` adds the
    weight-sync ones)."""
    inflight: dict[str, GenerateRequest] = {}
    tok = scoring.find_tokenizer(engine, model_path, tokenizer)
    state = {"paused": False, "started": time.time()}
    weights_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        yield
        if close_engine:
            await engine.aclose()

    app = new_fastapi_app(otel=otel, title="miles-engine (SGLang-compatible)", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _err(400, str(exc), exc.type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _err(400, str(exc), "BadRequestError")

    async def _run_generate(req: GenerateRequest, request: Request) -> Any:
        task = asyncio.ensure_future(engine.generate(req))
        while True:  # abort the request if the client goes away (as SGLang does)
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                await engine.abort(req.request_id)
                return await task

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await _json(request)
        if scoring.is_prefill_only(body):  # SGLang's scoring call (see .scoring)
            return await _score(scoring.scoring_request_from_wire(body))
        req = wire.request_from_wire(body, request.headers)
        start = wire.routed_experts_start(body)
        if req.request_id in inflight:
            raise BadRequest(f"rid {req.request_id!r} is already in flight")
        inflight[req.request_id] = req
        try:
            res = await _run_generate(req, request)
        except Exception as exc:  # noqa: BLE001 - mapped to an HTTP error, the server keeps serving
            status, type_ = _classify(exc)
            if status >= 500:
                log.exception("generate %s failed", req.request_id)
            return _err(status, f"{exc.__class__.__name__}: {exc}" if status >= 500 else str(exc), type_)
        finally:
            inflight.pop(req.request_id, None)
        return wire.result_to_wire(res, req, engine.weight_version, start)

    async def _score(req: scoring.ScoringRequest) -> Any:
        if req.rid in inflight:
            raise BadRequest(f"rid {req.rid!r} is already in flight")
        inflight[req.rid] = GenerateRequest(input_ids=req.input_ids, request_id=req.rid)
        try:
            return await scoring.score(engine, req)
        except BadRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an HTTP error, the server keeps serving
            status, type_ = _classify(exc)
            if status >= 500:
                log.exception("scoring %s failed", req.rid)
            return _err(status, f"{exc.__class__.__name__}: {exc}" if status >= 500 else str(exc), type_)
        finally:
            inflight.pop(req.rid, None)

    @app.post("/v1/tokenize")
    @app.post("/tokenize", include_in_schema=False)
    async def tokenize(request: Request) -> dict[str, Any]:
        return scoring.tokenize(tok, await _json(request), int(getattr(engine, "max_context_len", -1) or -1))

    async def _healthy() -> bool:
        try:
            return bool(await asyncio.wait_for(engine.health(), HEALTH_TIMEOUT_S))
        except Exception:  # noqa: BLE001
            log.exception("health check failed")
            return False

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await _healthy() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state["paused"] or inflight:  # busy or paused: a probe would only queue (SGLang skips it too)
            return await health()
        probe = GenerateRequest(input_ids=[0], sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
                                request_id=f"HEALTH_CHECK_{time.time()}")
        try:
            await asyncio.wait_for(engine.generate(probe), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            log.exception("health_generate probe failed")
            return Response(status_code=503)
        return Response(status_code=200)

    def _model_attrs() -> dict[str, Any]:
        keys = ("vocab_size", "max_context_len", "is_moe", "num_moe_layers", "moe_top_k")
        return {k: getattr(engine, k) for k in keys if getattr(engine, k, None) is not None}

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        path = model_path or getattr(engine, "model_path", None)
        return {"model_path": str(path) if path else None, "tokenizer_path": str(path) if path else None,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": str(engine.weight_version), **_model_attrs(),
                **({"tokenizer_vocab_size": tok.vocab_size} if tok is not None else {})}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": str(engine.weight_version)}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {"backend": "miles", "version": __version__, "engine": type(engine).__name__,
                "model_path": str(model_path) if model_path else None, "weight_version": str(engine.weight_version),
                "internal_states": [{"paused": state["paused"], "num_running_reqs": len(inflight),
                                     "uptime_s": round(time.time() - state["started"], 3)}]}

    @app.get("/miles/weight_metadata")
    async def weight_metadata() -> list[dict[str, Any]]:
        return [{"name": m.name, "dtype": m.dtype, "shape": list(m.shape), **({"format": m.format} if m.format else {})}
                for m in engine.weight_metadata()]

    async def _update(weights: Any, body: dict[str, Any]) -> JSONResponse:
        raw_version = body.get("weight_version")
        try:
            version = None if raw_version is None else wire.parse_version(raw_version)
        except ValueError as exc:
            return _err(400, str(exc), "BadRequestError", success=False, message=str(exc))
        if body.get("abort_all_requests"):
            await asyncio.gather(*(engine.abort(rid) for rid in list(inflight)))
        async with weights_lock:
            try:
                new = await engine.update_weights(weights, version=version)
            except Exception as exc:  # noqa: BLE001 - refused update: old weights keep serving
                status, type_ = _classify(exc)
                msg = f"weight update refused: {exc}"
                return _err(status, msg, type_, success=False, message=msg, num_paused_requests=0)
        return JSONResponse({"success": True, "message": f"Succeeded to update model weights. "
                             f"Weight version updated to {new}.", "num_paused_requests": 0})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path (a safetensors directory) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported (safetensors only)")
        if not Path(path).exists():
            msg = f"model_path {path!r} does not exist"
            return _err(400, msg, "BadRequestError", success=False, message=msg, num_paused_requests=0)
        return await _update(Path(path), body)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        body = await _json(request)
        if body.get("load_format") != tensors.TENSOR_LOAD_FORMAT:
            raise BadRequest(f"load_format must be {tensors.TENSOR_LOAD_FORMAT!r} (base64 safetensors blobs); "
                             f"SGLang's pickled MultiprocessingSerializer payloads are refused")
        named = tensors.decode_named_tensors(body.get("serialized_named_tensors"))
        return await _update(named, body)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        mode = (await _json(request, required=False)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        before = _pause_counters(engine)
        await engine.pause(mode)
        state["paused"] = True
        after = _pause_counters(engine)
        return {"message": "Generation paused successfully.", "status": "ok",
                "miles_pause": {k: after[k] - before.get(k, 0) for k in after}}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, str]:
        await _json(request, required=False)
        await engine.resume()
        state["paused"] = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await _json(request)
        rid = body.get("rid")
        if body.get("abort_all"):
            rids = list(inflight)
        elif isinstance(rid, str) and rid:
            rids = [rid]
        else:
            raise BadRequest("abort_request needs a string rid or abort_all=true")
        found = await asyncio.gather(*(engine.abort(r) for r in rids))
        return {"success": any(found), "aborted": [r for r, ok in zip(rids, found) if ok]}

    for add_routes in routes:
        add_routes(app, engine, weights_lock, _json)
    return app


def _pause_counters(engine: Any) -> dict[str, int]:
    """The engine's running totals of requests a pause retracted, kept or aborted (an engine without
    ``stats()`` reports none)."""
    stats = engine.stats() if callable(getattr(engine, "stats", None)) else {}
    return {k: int(stats[k]) for k in PAUSE_EFFECTS if isinstance(stats, dict) and k in stats}
