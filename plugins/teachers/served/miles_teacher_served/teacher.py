"""The ``served`` teacher: scores the student's exact ids with an SGLang-compatible server.

One ``POST /generate`` per row with ``sampling_params.max_new_tokens = 0`` (SGLang's
prefill-only request: no token is ever sampled), ``return_logprob``, ``logprob_start_len``,
``top_logprobs_num`` and ``token_ids_logprob``; see :mod:`.wire` for the answer's shape.
Scoring is idempotent, so transport errors, 5xx and 503 answers are retried with backoff; a
4xx answer is the server refusing the request and is raised at once with its message.

Start-up tokenizer check (:meth:`ServedTeacher.fingerprint`): real SGLang exposes its
tokenizer through ``POST /v1/tokenize`` (``{"prompt": [...], "add_special_tokens": false}``
→ ``{"tokens": [[...], ...]}``) but reports no vocabulary size (``/get_model_info`` has
``model_path``, ``tokenizer_path``, ``is_generation``, ``weight_version``); miles' server adds
``tokenizer_vocab_size`` there. Without it, ``options.vocab_size`` is required. With
``options.tokenizer`` the check reads that file instead (for servers without ``/v1/tokenize``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import httpx

from miles_engine.errors import ConfigError
from miles_engine.teachers.compat import VocabFingerprint, fingerprint_tokenizer
from miles_engine.teachers.protocol import ScoreRequest, TeacherError, TokenScores
from miles_teacher_served.options import ServedTeacherOptions
from miles_teacher_served.wire import read_scores, request_body

log = logging.getLogger(__name__)
_RETRY_STATUS = frozenset({500, 502, 503, 504})


class ServedTeacher:
    def __init__(self, options: ServedTeacherOptions, *, name: str = "served") -> None:
        self.name, self.options = name, options
        headers: dict[str, str] = {}
        if options.api_key_env:
            key = os.environ.get(options.api_key_env)
            if not key:
                raise ConfigError(f"teacher '{name}': environment variable {options.api_key_env} "
                                  f"(options.api_key_env) is not set")
            headers[options.auth_header] = f"Bearer {key}" if options.auth_header.lower() == "authorization" else key
        self._headers = headers
        self._timeout = httpx.Timeout(options.timeout_s, connect=min(10.0, options.timeout_s))
        self._client: httpx.AsyncClient | None = None
        self._gate: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests_sent = 0

    def __repr__(self) -> str:
        return f"ServedTeacher({self.name!r}, {self.options.url!r})"

    # ------------------------------------------------------------------ plumbing
    def _where(self, path: str) -> str:
        return f"teacher '{self.name}' ({self.options.url}{path})"

    def _async_client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # clients are bound to the loop that made them
            self._client = httpx.AsyncClient(base_url=self.options.url, headers=self._headers, timeout=self._timeout,
                                             limits=httpx.Limits(max_connections=self.options.max_concurrency))
            self._gate, self._loop = asyncio.Semaphore(self.options.max_concurrency), loop
        assert self._gate is not None
        return self._client, self._gate

    @staticmethod
    def _message(resp: httpx.Response) -> str:
        try:
            body = resp.json()
        except ValueError:
            return resp.text[:300] or resp.reason_phrase
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            if isinstance(err, str) and err:  # SGLang's API-key middleware: {"error": "Unauthorized"}
                return err
            for key in ("message", "detail"):
                if body.get(key):
                    return str(body[key])
        return str(body)[:300]

    def _check(self, resp: httpx.Response, path: str) -> Any:
        if resp.status_code >= 400:
            raise TeacherError(f"{self._where(path)} answered HTTP {resp.status_code}: {self._message(resp)}")
        try:
            return resp.json()
        except ValueError:
            raise TeacherError(f"{self._where(path)}: malformed answer: not JSON: {resp.text[:200]!r}") from None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        client, gate = self._async_client()
        attempts = 1 + self.options.retries
        last = ""
        async with gate:
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(self.options.backoff_s * 2 ** (attempt - 1))
                try:
                    resp = await client.post(path, json=body)
                except httpx.TransportError as exc:
                    last = f"{exc.__class__.__name__}: {exc}"
                    continue
                self.requests_sent += 1
                if resp.status_code in _RETRY_STATUS:
                    last = f"HTTP {resp.status_code}: {self._message(resp)}"
                    continue
                return self._check(resp, path)
        raise TeacherError(f"{self._where(path)} did not answer after {attempts} attempt(s): {last}")

    # ------------------------------------------------------------------ protocol
    async def score(self, requests: Sequence[ScoreRequest]) -> list[TokenScores]:
        out: list[TokenScores] = []
        step = self.options.max_batch_rows
        for i in range(0, len(requests), step):
            out += await asyncio.gather(*(self._score_one(r) for r in requests[i:i + step]))
        return out

    async def _score_one(self, req: ScoreRequest) -> TokenScores:
        body, start = request_body(req, self.options.top_k)
        data = await self._post("/generate", body)
        return read_scores(data, req, body, start, self._where("/generate"))

    def fingerprint(self, probe: str, special_tokens: Sequence[str]) -> VocabFingerprint:
        if self.options.tokenizer is not None:
            return fingerprint_tokenizer(self.options.tokenizer, probe, special_tokens)
        with httpx.Client(base_url=self.options.url, headers=self._headers, timeout=self._timeout) as client:
            info = self._sync_call(client, "GET", "/get_model_info", None)
            vocab = self.options.vocab_size or (info.get("tokenizer_vocab_size") if isinstance(info, dict) else None)
            if not isinstance(vocab, int):
                raise ConfigError(f"{self._where('/get_model_info')} reports no tokenizer_vocab_size (real SGLang "
                                  f"does not): set options.vocab_size to the served tokenizer's size, or "
                                  f"options.tokenizer to its tokenizer file")
            texts = [probe, *special_tokens]
            got = self._sync_call(client, "POST", "/v1/tokenize", {"prompt": texts, "add_special_tokens": False})
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if not (isinstance(tokens, list) and len(tokens) == len(texts)
                and all(isinstance(t, list) and all(isinstance(i, int) for i in t) for t in tokens)):
            raise TeacherError(f"{self._where('/v1/tokenize')}: malformed answer: tokens is not one id list per "
                               f"prompt ({len(texts)} asked): {str(got)[:200]!r}")
        special = {s: (ids[0] if len(ids) == 1 else None) for s, ids in zip(special_tokens, tokens[1:])}
        return VocabFingerprint(int(vocab), special, tuple(tokens[0]))

    def _sync_call(self, client: httpx.Client, method: str, path: str, body: Any) -> Any:
        attempts, last = 1 + self.options.retries, ""
        for attempt in range(attempts):
            if attempt:
                import time

                time.sleep(self.options.backoff_s * 2 ** (attempt - 1))
            try:
                resp = client.request(method, path, json=body)
            except httpx.TransportError as exc:
                last = f"{exc.__class__.__name__}: {exc}"
                continue
            if resp.status_code in _RETRY_STATUS:
                last = f"HTTP {resp.status_code}: {self._message(resp)}"
                continue
            if resp.status_code == 404 and path == "/v1/tokenize":
                raise ConfigError(f"{self._where(path)} does not exist: the server exposes no tokenizer; set "
                                  f"options.tokenizer to the served model's tokenizer for the start-up id check")
            return self._check(resp, path)
        raise TeacherError(f"{self._where(path)} did not answer after {attempts} attempt(s): {last}")

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except RuntimeError:  # its loop is gone; the sockets went with it
                log.debug("teacher %s: client loop already closed", self.name)
