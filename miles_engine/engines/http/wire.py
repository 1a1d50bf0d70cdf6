"""The SGLang ``/generate`` wire format (the subset we use), shared by our server and our client.

Matched against sgl-project/sglang ``python/sglang/srt``: ``managers/io_struct.py``
(``GenerateReqInput``), ``sampling/sampling_params.py`` (``SamplingParams``: key names, ``top_k``
default ``1 << 30``, ``sampling_seed``), ``managers/tokenizer_manager.py`` (``meta_info``:
``output_token_logprobs`` as ``[logprob, token_id, text|None]``), ``managers/schedule_batch.py``
(``finish_reason`` JSON) and ``utils/weight_versions.py`` (``meta_info["weight_versions"]`` spans
``{"version", "start", "end"}`` beside the legacy one-per-request ``weight_version``).

Extensions (absent from real SGLang, additive): ``meta_info["routed_experts_shape"]``, an
``error.type`` in 400 bodies, and ``load_format="miles_safetensors"`` tensor payloads
(:mod:`.tensors`).
"""

from __future__ import annotations

import base64
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from miles_engine.engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from miles_engine.errors import did_you_mean

# Session affinity: the header Miles' session server and sgl-model-gateway use, plus SGLang's
# own body fields (``routing_key``; ``session_id`` in recent versions). See docs in server.py.
SESSION_HEADER = "X-SMG-Routing-Key"
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
DEFAULT_VERSION_NAMES = {"default", ""}  # SGLang's server_args.weight_version before any update


class BadRequest(ValueError):
    """A request refused with HTTP 400; the engine keeps serving."""

    def __init__(self, message: str, type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.type = type_


def error_body(message: str, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_}}


# --------------------------------------------------------------------------- sampling params
_SAMPLING_DIRECT = ("temperature", "top_p", "top_k", "max_new_tokens")
# Output formatting / stopping knobs with no effect on token ids: any value is accepted.
# ``ignore_eos``: our engines stop only on ``stop_token_ids`` (list EOS there).
_SAMPLING_COSMETIC = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "ignore_eos"}
# Real SGLang knobs we do not implement: accepted only at their SGLang default.
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1, "min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "stop": None, "stop_regex": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None,
    "stream_interval": None,
}
_SAMPLING_KNOWN = (*_SAMPLING_DIRECT, "stop_token_ids", "sampling_seed", *_SAMPLING_COSMETIC, *_SAMPLING_DEFAULTS)


def _is_default(value: Any, default: Any) -> bool:
    return value is None or value == default or (default is None and value in ([], "", {}))


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{what} must be a list of integers")
    return value


def sampling_to_wire(s: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_new_tokens": s.max_new_tokens,
    }
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    return out


def sampling_from_wire(raw: Any) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be a JSON object")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SAMPLING_DIRECT:
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise BadRequest(f"sampling_params.{key} must be a number, got {value!r}")
                kw[key] = value
        elif key == "stop_token_ids":
            if value:
                kw["stop_token_ids"] = tuple(_int_list(list(value) if isinstance(value, tuple) else value,
                                                       "sampling_params.stop_token_ids"))
        elif key == "sampling_seed":
            if value is not None:
                kw["seed"] = value
        elif key in _SAMPLING_COSMETIC:
            continue
        elif key in _SAMPLING_DEFAULTS:
            if not _is_default(value, _SAMPLING_DEFAULTS[key]):
                raise BadRequest(f"sampling_params.{key}={value!r} is not supported by this engine "
                                 f"(only its default {_SAMPLING_DEFAULTS[key]!r})")
        else:
            raise BadRequest(f"unknown sampling_params key '{key}'{did_you_mean(key, _SAMPLING_KNOWN)}")
    if isinstance(kw.get("top_k"), int) and kw["top_k"] >= TOP_K_ALL:
        kw["top_k"] = -1
    if isinstance(kw.get("max_new_tokens"), float):
        raise BadRequest("sampling_params.max_new_tokens must be an integer")
    try:
        return SamplingParams(**kw)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'sampling_params'}: {e['msg']}" for e in exc.errors())
        raise BadRequest(f"invalid sampling_params: {msgs}") from None


# --------------------------------------------------------------------------- /generate request
# Real GenerateReqInput fields we accept but do not act on, with the values we accept.
_TOLERATED: dict[str, Any] = {
    "stream": False, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
    "return_hidden_states": False, "lora_path": None, "lora_id": None, "session_params": None,
    "input_embeds": None, "text": None, "image_data": None, "video_data": None, "audio_data": None,
    "return_entropy": False, "custom_logit_processor": None, "return_sampling_mask": False,
}
_SCORING_ONLY = ("logprob_start_len", "top_logprobs_num", "token_ids_logprob")
_ANY_VALUE = {"return_text_in_logprobs", "log_metrics", "no_logs", "custom_labels", "priority",
              "extra_key", "cache_salt", "routed_experts_start_len", "return_indexer_topk",
              "conversation_id", "external_trace_header", "received_time"}
_REQ_KNOWN = ("input_ids", "sampling_params", "return_logprob", "return_routed_experts", "rid",
              "session_id", "routing_key", *_TOLERATED, *_ANY_VALUE)


def request_to_wire(req: GenerateRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """Body and headers for ``POST /generate``. Log-probs are always requested: a real SGLang
    server returns the output token ids inside ``output_token_logprobs``."""
    body: dict[str, Any] = {
        "rid": req.request_id, "input_ids": list(req.input_ids),
        "sampling_params": sampling_to_wire(req.sampling), "return_logprob": True,
    }
    headers: dict[str, str] = {}
    if req.return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = max(len(req.input_ids) - 1, 0)
    if req.session_id is not None:
        body["routing_key"] = req.session_id
        headers[SESSION_HEADER] = req.session_id
    return body, headers


def request_from_wire(body: Any, headers: Mapping[str, str] | None = None) -> GenerateRequest:
    """A validated :class:`GenerateRequest`; raises :class:`BadRequest`. Also see
    :func:`routed_experts_start` for the one SGLang field the response shape depends on."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key, value in body.items():
        if key in _TOLERATED and not _is_default(value, _TOLERATED[key]):
            what = ("prompts must be token ids: send input_ids" if key in ("text", "input_embeds")
                    else f"{key}={value!r} is only supported on a prefill-only scoring request "
                         f"(sampling_params.max_new_tokens=0)" if key in _SCORING_ONLY
                    else f"{key}={value!r} is not supported by this engine")
            raise BadRequest(what)
        if key not in _REQ_KNOWN:
            raise BadRequest(f"unknown request field '{key}'{did_you_mean(key, _REQ_KNOWN)}")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids is required (token ids only; text prompts are not accepted)")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise BadRequest("batched input_ids are not supported: send one request per prompt")
    ids = _int_list(ids, "input_ids")
    if not ids:
        raise BadRequest("input_ids is empty")
    flags = {}
    for key in ("return_logprob", "return_routed_experts"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"{key} must be a boolean")
        flags[key] = bool(value)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string (batched rids are not supported)")
    session = body.get("session_id") or body.get("routing_key") or (headers or {}).get(SESSION_HEADER.lower())
    if session is not None and not isinstance(session, str):
        raise BadRequest("session_id / routing_key must be a string")
    return GenerateRequest(
        input_ids=ids, sampling=sampling_from_wire(body.get("sampling_params")), session_id=session,
        return_logprob=flags["return_logprob"], return_routed_experts=flags["return_routed_experts"],
        request_id=rid or uuid.uuid4().hex,
    )


def routed_experts_start(body: Mapping[str, Any]) -> int:
    """SGLang's ``routed_experts_start_len`` (rows cover positions ``[start, seqlen - 1)``)."""
    start = body.get("routed_experts_start_len") or 0
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise BadRequest("routed_experts_start_len must be a non-negative integer")
    return start


# --------------------------------------------------------------------------- versions
def parse_version(value: Any) -> int:
    """SGLang weight versions are strings; ours are ints. ``"default"`` (never updated) is 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value.strip() in DEFAULT_VERSION_NAMES:
            return 0
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"weight version {value!r} is not an integer (miles versions are integers)")


def versions_to_spans(versions: Sequence[int]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def spans_to_versions(spans: Sequence[Mapping[str, Any]], n: int) -> list[int] | None:
    out: list[int | None] = [None] * n
    for span in spans:
        v = parse_version(span["version"])
        for i in range(max(int(span["start"]), 0), min(int(span["end"]), n)):
            out[i] = v
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


# --------------------------------------------------------------------------- routed experts
def encode_routed_experts(rows: Sequence[Sequence[Sequence[int]]]) -> tuple[str, list[int]]:
    import numpy as np

    arr = np.asarray(rows, dtype=np.int32)
    if arr.ndim != 3:
        arr = arr.reshape(len(rows), -1, 1) if len(rows) else np.zeros((0, 0, 0), np.int32)
    return base64.b64encode(arr.tobytes()).decode("ascii"), list(arr.shape)


def routed_experts_shape(config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """``(layers, top_k)`` of an MoE model's routed experts as SGLang sends them (one row of top-k
    ids per decoder layer: Miles reads them so), from its Hugging Face config; None for a dense model."""
    if not config:
        return None
    top_k = next((config[k] for k in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
                  if isinstance(config.get(k), int) and config[k] > 0), None)
    layers = config.get("num_hidden_layers")
    if top_k is None or not isinstance(layers, int) or not (config.get("num_experts") or config.get("n_routed_experts")
                                                             or config.get("num_local_experts")):
        return None
    return layers, int(top_k)


def decode_routed_experts(data: str, shape: Sequence[int] | None, completion_tokens: int,
                          moe_shape: tuple[int, int] | None) -> list[list[list[int]]]:
    import numpy as np

    flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if shape is not None:
        arr = flat.reshape(tuple(shape))
    elif moe_shape is not None:
        arr = flat.reshape(-1, *moe_shape)
    else:
        raise ValueError("routed_experts came without a shape: give the client moe_shape=(layers, top_k)")
    # SGLang returns rows for positions [routed_experts_start_len, seqlen - 1): the last
    # completion_tokens rows are the forward passes that sampled the output tokens.
    return arr[arr.shape[0] - completion_tokens:].tolist() if completion_tokens else []


# --------------------------------------------------------------------------- /generate response
def finish_reason_to_wire(res: GenerateResult) -> dict[str, Any]:
    if res.finish_reason == "stop":
        return {"type": "stop", "matched": res.output_ids[-1] if res.output_ids else None}
    if res.finish_reason == "length":
        return {"type": "length", "length": len(res.output_ids)}
    return {"type": "abort", "message": str(res.info.get("abort_message", "request aborted"))}


def _routed_rows(res: GenerateResult, start: int) -> list[Any]:
    """SGLang's rows ``[start, prompt + completion - 1)`` when the engine reports the prompt rows
    (``info["prompt_routed_experts"]``, embedded engine); else the completion rows only."""
    prompt_rows = res.info.get("prompt_routed_experts")
    if prompt_rows is None:
        return list(res.routed_experts or [])
    return [*prompt_rows, *(res.routed_experts or [])][min(start, len(prompt_rows)):]


def result_to_wire(res: GenerateResult, req: GenerateRequest, current_version: int,
                   routed_experts_start_len: int = 0) -> dict[str, Any]:
    spans = versions_to_spans(res.weight_versions)
    meta: dict[str, Any] = {
        "id": res.request_id, "finish_reason": finish_reason_to_wire(res),
        "prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.output_ids),
        "cached_tokens": res.cached_tokens, "weight_versions": spans,
        "weight_version": spans[-1]["version"] if spans else str(current_version),
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                         for lp, t in zip(res.output_logprobs, res.output_ids)]
    if res.routed_experts is not None:
        meta["routed_experts"], meta["routed_experts_shape"] = encode_routed_experts(
            _routed_rows(res, routed_experts_start_len))
    for ours, theirs in (("retractions", "num_retractions"), ("latency_s", "e2e_latency")):
        if ours in res.info:
            meta[theirs] = res.info[ours]
    return {"text": "", "output_ids": list(res.output_ids), "meta_info": meta}


_FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


def result_from_wire(data: Mapping[str, Any], req: GenerateRequest,
                     moe_shape: tuple[int, int] | None = None) -> GenerateResult:
    meta = data.get("meta_info") or {}
    otl = meta.get("output_token_logprobs")
    ids = data.get("output_ids")
    if ids is None:
        if otl is None:
            raise ValueError("response has neither output_ids nor meta_info.output_token_logprobs")
        ids = [int(e[1]) for e in otl]
    ids = [int(t) for t in ids]
    if otl is not None and len(otl) != len(ids):
        raise ValueError(f"{len(otl)} log-probs for {len(ids)} output tokens")
    logprobs = [math.nan if e[0] is None else float(e[0]) for e in otl] if otl is not None else [math.nan] * len(ids)
    fr = meta.get("finish_reason")
    fr_type = fr.get("type") if isinstance(fr, dict) else fr
    info: dict[str, Any] = {"finish_reason_raw": fr}
    finish = _FINISH_TYPES.get(fr_type or "", "abort")
    if finish == "abort" and isinstance(fr, dict) and fr.get("message"):
        info["abort_message"] = fr["message"]
    versions = spans_to_versions(meta["weight_versions"], len(ids)) if meta.get("weight_versions") else None
    info["weight_versions_exact"] = versions is not None
    if versions is None:  # older SGLang: one version per request; every token gets it
        versions = [parse_version(meta.get("weight_version", "default"))] * len(ids)
    routed = None
    if meta.get("routed_experts") is not None:
        routed = decode_routed_experts(meta["routed_experts"], meta.get("routed_experts_shape"), len(ids), moe_shape)
    for theirs, ours in (("num_retractions", "retractions"), ("e2e_latency", "latency_s"), ("dp_rank", "dp_rank")):
        if theirs in meta:
            info[ours] = meta[theirs]
    return GenerateResult(
        request_id=str(meta.get("id") or req.request_id), output_ids=ids, output_logprobs=logprobs,
        weight_versions=versions, finish_reason=finish,  # type: ignore[arg-type]
        prompt_tokens=int(meta.get("prompt_tokens", len(req.input_ids))),
        cached_tokens=int(meta.get("cached_tokens") or 0), routed_experts=routed, info=info,
    )
