"""A resources server following NeMo Gym's wire format, for the tests (run with uvicorn).

Like ``SimpleResourcesServer``: ``POST /seed_session`` receives the dataset row and starts a
per-rollout session kept in a cookie; tool routes are ``POST /{tool}`` with the call's JSON
arguments as body; ``POST /verify`` receives ``row | {"response": Response}`` (validated with the
``openai`` Response types NeMo Gym's ``NeMoGymResponse`` extends) and answers the request echoed
plus ``reward``. The task: read this session's secret with ``get_secret``, multiply it with
``multiply``, and answer the product; verify checks the answer and that this session used both
tools. The row field ``verify_mode`` makes ``/verify`` misbehave on purpose.
"""

from __future__ import annotations

import uuid
from typing import Any, Union

from fastapi import FastAPI, HTTPException, Request
from fastapi import Response as HTTPResponse
from fastapi.responses import JSONResponse, PlainTextResponse
from openai.types.responses import Response, ResponseOutputItem
from openai.types.responses.response_input_param import FunctionCallOutput
from pydantic import BaseModel, ConfigDict

COOKIE = "session"
app = FastAPI()
SESSIONS: dict[str, dict[str, Any]] = {}


class NeMoGymResponse(Response):
    output: list[Union[FunctionCallOutput, ResponseOutputItem]]  # noqa: UP007 - as NeMo Gym declares it


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    responses_create_params: dict[str, Any]
    response: NeMoGymResponse
    expected_answer: str
    verify_mode: str = "normal"


class MultiplyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: float
    b: float


def _session(request: Request) -> dict[str, Any]:
    sid = request.cookies.get(COOKIE)
    if sid not in SESSIONS:
        raise HTTPException(400, "no session: call /seed_session first (session cookie missing or unknown)")
    return SESSIONS[sid]


@app.post("/seed_session")
async def seed_session(request: Request, response: HTTPResponse) -> dict[str, Any]:
    row = await request.json()
    if "responses_create_params" not in row:
        raise HTTPException(422, "seed_session expects the dataset row")
    sid = uuid.uuid4().hex
    SESSIONS[sid] = {"secret": row.get("secret", 0), "calls": []}
    response.set_cookie(COOKIE, sid)
    return {}


@app.post("/get_secret")
async def get_secret(request: Request) -> dict[str, Any]:
    session = _session(request)
    session["calls"].append("get_secret")
    return {"secret": session["secret"]}


@app.post("/multiply")
async def multiply(request: Request, body: MultiplyRequest) -> dict[str, Any]:
    session = _session(request)
    session["calls"].append("multiply")
    product = body.a * body.b
    return {"product": int(product) if product.is_integer() else product}


def _final_text(response: NeMoGymResponse) -> str:
    texts = [part.text for item in response.output if getattr(item, "type", None) == "message"
             for part in item.content if getattr(part, "type", None) == "output_text"]
    return texts[-1] if texts else ""


@app.post("/verify")
async def verify(request: Request, body: VerifyRequest) -> Any:
    mode = body.verify_mode
    if mode == "text":
        return PlainTextResponse("reward: lots")
    if mode == "no_reward":
        return {"score": 1.0}
    if mode == "string_reward":
        return {"reward": "high"}
    if mode == "http500":
        return JSONResponse({"detail": "judge crashed"}, status_code=500)
    session = _session(request)
    used = {"get_secret", "multiply"} <= set(session["calls"])
    correct = _final_text(body.response).strip() == body.expected_answer
    reward = 1.0 if used and correct else 0.0
    extra: dict[str, Any] = {"reward_components": {"correct": float(correct), "used_tools": float(used)}}
    if mode == "masked":
        extra.update(mask_sample=True, failure_kind="judge_unavailable", failure_reason="judge timed out")
    return {**body.model_dump(mode="json"), "reward": reward, **extra}
