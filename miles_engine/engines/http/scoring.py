"""SGLang's prefill-only scoring call on ``/generate``, and ``/v1/tokenize``.

Scoring (matched against sgl-project/sglang ``srt/managers/io_struct.py`` ``GenerateReqInput``,
``scheduler_output_processor_mixin.add_input_logprob_return_values`` and the
``tokenizer_manager`` meta_info assembly)::

    POST /generate {"input_ids": [...], "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": true, "logprob_start_len": S, "top_logprobs_num": K,
                    "token_ids_logprob": [ids...]}

answers ``output_ids: []``, ``finish_reason {"type": "length", "length": 0}`` and, in
``meta_info``, ``input_token_logprobs``: one ``[logprob, token_id, text|None]`` per token of
``input_ids[S:]``, the first one's logprob ``None`` (no position predicts it: SGLang pads it);
``input_top_logprobs`` / ``input_token_ids_logprobs``: ``None`` first, then per token a list of
``[logprob, token_id, None]`` (top-K most likely first; the asked ids in request order).
``logprob_start_len`` -1 (the default) on a prefill-only request means no input log-probs
(SGLang sets it to ``len(input_ids)``); ``S >= len(input_ids)`` is refused. Log-probs are the
raw logits' log-softmax (no temperature), as SGLang's input log-probs. ``text`` is always
``None`` (``return_text_in_logprobs`` is accepted and ignored).

``POST /v1/tokenize`` (and ``/tokenize``), SGLang's ``OpenAIServingTokenize``:
``{"prompt": str | [str], "add_special_tokens": true}`` → ``{"tokens", "count", "max_model_len"}``;
served when the server has a tokenizer (a model directory with ``tokenizer.json``).
``/get_model_info`` then also reports ``tokenizer_vocab_size`` (ours; SGLang reports none).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.engines.http import wire
from miles_engine.engines.http.wire import BadRequest
from miles_engine.models.tokenizer import load_tokenizer

SCORING_FIELDS = ("logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs")


@dataclass(frozen=True)
class ScoringRequest:
    rid: str
    input_ids: list[int]
    start: int
    top_n: int
    token_ids: list[int] | None
    return_logprob: bool


def is_prefill_only(body: dict[str, Any]) -> bool:
    """``sampling_params.max_new_tokens == 0``: SGLang's prefill-only (scoring) request."""
    sp = body.get("sampling_params")
    value = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    return isinstance(value, int) and not isinstance(value, bool) and value == 0


def _int(body: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def scoring_request_from_wire(body: dict[str, Any]) -> ScoringRequest:
    """Validate a prefill-only request; every other field is checked as for generation."""
    rest = {k: v for k, v in body.items() if k not in SCORING_FIELDS}
    probe = {**rest, "sampling_params": {**body["sampling_params"], "max_new_tokens": 1}}
    req = wire.request_from_wire(probe)  # unknown fields, input_ids, sampling knobs, rid, flags
    ids = list(req.input_ids)
    n = len(ids)
    raw_start = _int(body, "logprob_start_len", -1, -1)
    start = n if raw_start == -1 else raw_start
    if raw_start >= n:
        raise BadRequest(f"logprob_start_len={raw_start} is higher than the number of input tokens {n}. "
                         f"Please use a smaller logprob_start_len.")
    asked = body.get("token_ids_logprob")
    if asked is not None:
        asked = wire._int_list(asked, "token_ids_logprob")
    flag = body.get("return_text_in_logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise BadRequest("return_text_in_logprobs must be a boolean")
    return ScoringRequest(rid=body.get("rid") or uuid.uuid4().hex, input_ids=ids, start=start,
                          top_n=_int(body, "top_logprobs_num", 0, 0), token_ids=asked,
                          return_logprob=req.return_logprob)


def _entries(values: list[list[float]], ids: list[list[int]]) -> list[Any]:
    """SGLang's per-token candidate lists: ``None`` for the first token, then ``[lp, id, None]``s."""
    return [None, *([[float(lp), int(t), None] for lp, t in zip(row, row_ids)] for row, row_ids in zip(values, ids))]


def scoring_result_to_wire(req: ScoringRequest, scores: Any, weight_version: int) -> dict[str, Any]:
    """The response body; ``scores`` is a ``PromptLogprobs`` (``None`` when nothing was asked)."""
    n = len(req.input_ids)
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": n,
        "completion_tokens": 0, "cached_tokens": 0, "weight_version": str(weight_version), "weight_versions": [],
    }
    if req.return_logprob:
        tokens = req.input_ids[req.start:]
        entries: list[list[Any]] = [[None, tokens[0], None]] if tokens else []
        if scores is not None:
            entries += [[float(lp), int(t), None] for lp, t in zip(scores.token, tokens[1:])]
        meta["input_token_logprobs"], meta["output_token_logprobs"] = entries, []
        if req.top_n > 0:
            meta["input_top_logprobs"] = (_entries(scores.top_logprobs, scores.top_ids)
                                          if scores is not None else [None]) if tokens else []
            meta["output_top_logprobs"] = []
        if req.token_ids is not None:
            meta["input_token_ids_logprobs"] = (_entries(scores.asked, [req.token_ids] * len(scores.asked))
                                                if scores is not None else [None]) if tokens else []
            meta["output_token_ids_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}


async def score(engine: Any, req: ScoringRequest) -> dict[str, Any]:
    """Run ``req`` on an engine that implements ``score_prompt`` (the embedded engine)."""
    wants = req.return_logprob and req.start < len(req.input_ids) - 1
    if wants and not callable(getattr(engine, "score_prompt", None)):
        raise BadRequest(f"this engine ({type(engine).__name__}) cannot score prompts "
                         f"(prefill-only requests with return_logprob need the embedded engine)")
    scores = None
    if wants:
        scores = await engine.score_prompt(req.input_ids, req.start, req.top_n if req.return_logprob else 0,
                                           req.token_ids)
    return scoring_result_to_wire(req, scores, engine.weight_version)


# --------------------------------------------------------------------------- tokenizer
def find_tokenizer(engine: Any, model_path: str | None, tokenizer: Any) -> Any:
    """The server's tokenizer: the one given, else ``tokenizer.json`` in the model directory."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = model_path or getattr(engine, "model_path", None)
    if path and Path(str(path)).is_dir() and (Path(str(path)) / "tokenizer.json").is_file():
        return load_tokenizer(Path(str(path)))
    return None


def tokenize(tok: Any, body: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    if tok is None:
        raise BadRequest("this server has no tokenizer: start it with a model directory holding tokenizer.json")
    prompt = body.get("prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise BadRequest("add_special_tokens must be a boolean")

    def encode(text: str) -> list[int]:
        return list(tok.backend.encode(text, add_special_tokens=special).ids) if text else []

    if isinstance(prompt, str):
        ids = encode(prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        rows = [encode(p) for p in prompt]
        return {"tokens": rows, "count": [len(r) for r in rows], "max_model_len": max_model_len}
    raise BadRequest(f"Invalid prompt type: {type(prompt).__name__}. Expected str or List[str].")
