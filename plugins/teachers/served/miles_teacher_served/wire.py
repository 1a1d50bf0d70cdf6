"""SGLang's prefill-only scoring call: the request body for one :class:`ScoreRequest` and the
answer's ``meta_info`` read back into :class:`TokenScores`.

SGLang (``scheduler_output_processor_mixin.add_input_logprob_return_values``) returns one
``input_token_logprobs`` entry per token of ``input_ids[logprob_start_len:]``; the first entry's
log-prob is ``None`` because no computed position predicts it. So to score positions ``P`` we
send ``logprob_start_len = min(P) - 1`` and read position ``p`` at entry ``p - start``
(``>= 1``). Every entry's token id is checked against the row: an answer for other ids (an
off-by-one, a server that re-tokenised) is refused, never silently misaligned.
"""

from __future__ import annotations

import math
from typing import Any

from miles_engine.teachers.protocol import ScoreRequest, TeacherError, TokenScores


def request_body(req: ScoreRequest, top_k: int | None) -> tuple[dict[str, Any], int]:
    """``(body, logprob_start_len)`` for ``POST /generate``."""
    start = (req.positions[0] - 1) if req.positions else len(req.token_ids) - 1
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in req.token_ids],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": start,
    }
    if req.top_k:
        if top_k is not None and top_k < req.top_k:
            raise TeacherError(f"options.top_k={top_k} is below the top-{req.top_k} the trainer asks for "
                               f"(trainer.opd.top_k): raise options.top_k or leave it unset")
        body["top_logprobs_num"] = top_k or req.top_k
    if req.candidate_ids is not None:
        asked = sorted({int(c) for cands in req.candidate_ids for c in cands})
        if asked:
            body["token_ids_logprob"] = asked
    return body, start


class _Reader:
    def __init__(self, meta: dict[str, Any], where: str) -> None:
        self.meta, self.where = meta, where

    def fail(self, field: str, why: str) -> TeacherError:
        return TeacherError(f"{self.where}: malformed answer: meta_info.{field} {why}")

    def entries(self, field: str, expected: int) -> list[Any]:
        value = self.meta.get(field)
        if not isinstance(value, list):
            raise self.fail(field, f"is missing or not a list (got {type(value).__name__})")
        if len(value) != expected:
            raise self.fail(field, f"has {len(value)} entries for {expected} tokens from logprob_start_len: "
                            f"length mismatch, answer refused")
        return value

    def logprob(self, field: str, entry: Any, index: str) -> tuple[float, int]:
        if not (isinstance(entry, (list, tuple)) and len(entry) in (2, 3)):
            raise self.fail(f"{field}{index}", f"is not a [logprob, token_id, text] entry: {entry!r:.80}")
        lp, tid = entry[0], entry[1]
        if isinstance(tid, bool) or not isinstance(tid, int):
            raise self.fail(f"{field}{index}", f"has token id {tid!r}, not an integer")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise self.fail(f"{field}{index}", f"has log-prob {lp!r}, not a finite number")
        return float(lp), tid

    def candidates(self, field: str, entry: Any, index: str) -> list[tuple[float, int]]:
        if not isinstance(entry, list):
            raise self.fail(f"{field}{index}", f"is not a list of [logprob, token_id, text] entries: {entry!r:.80}")
        return [self.logprob(field, e, f"{index}[{i}]") for i, e in enumerate(entry)]


def read_scores(data: Any, req: ScoreRequest, body: dict[str, Any], start: int, where: str) -> TokenScores:
    """Turn one ``/generate`` answer into :class:`TokenScores`; raise :class:`TeacherError` naming
    the field when the answer does not have SGLang's shape for ``req``."""
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise TeacherError(f"{where}: malformed answer: no meta_info object in {str(data)[:200]!r}")
    r = _Reader(data["meta_info"], where)
    ids = [int(t) for t in req.token_ids]
    n_entries = len(ids) - start
    tokens = r.entries("input_token_logprobs", n_entries)
    out = TokenScores([0.0] * len(ids))
    for p in req.positions:
        j = p - start
        lp, tid = r.logprob("input_token_logprobs", tokens[j], f"[{j}]")
        if tid != ids[p]:
            raise r.fail(f"input_token_logprobs[{j}]", f"is for token id {tid} but token {p} of the row is {ids[p]} "
                         f"(misaligned answer refused)")
        out.logprobs[p] = lp
    if req.top_k:
        top = r.entries("input_top_logprobs", n_entries)
        for p in req.positions:
            pairs = r.candidates("input_top_logprobs", top[p - start], f"[{p - start}]")
            if len(pairs) < req.top_k:
                raise r.fail(f"input_top_logprobs[{p - start}]", f"has {len(pairs)} entries, {req.top_k} were asked")
            pairs = sorted(pairs, key=lambda e: (-e[0], e[1]))[:req.top_k]
            out.top_ids.append([t for _, t in pairs])
            out.top_logprobs.append([lp for lp, _ in pairs])
    if req.candidate_ids is not None:
        asked = body.get("token_ids_logprob")
        got = r.entries("input_token_ids_logprobs", n_entries) if asked else None
        for j, (p, cands) in enumerate(zip(req.positions, req.candidate_ids)):
            by_id = {t: lp for lp, t in r.candidates("input_token_ids_logprobs", got[p - start],
                                                      f"[{p - start}]")} if got is not None else {}
            missing = [c for c in cands if int(c) not in by_id]
            if missing:
                raise r.fail(f"input_token_ids_logprobs[{p - start}]", f"lacks the asked ids {missing[:5]}")
            out.candidate_logprobs.append([by_id[int(c)] for c in cands])
    return out
