"""Typed options of the ``served`` teacher."""

from __future__ import annotations

from pydantic import Field, field_validator

from miles_engine.components import Section


class ServedTeacherOptions(Section):
    url: str = Field(description="base URL of the server, e.g. http://127.0.0.1:30000 (SGLang or miles serve)")
    timeout_s: float = Field(120.0, gt=0, description="per scoring request (connect: min(10, timeout_s))")
    retries: int = Field(3, ge=0, le=20, description="re-sends after a transport error, 5xx or 503 "
                         "(scoring is idempotent); 4xx answers are never retried")
    backoff_s: float = Field(0.5, ge=0, description="first retry delay, doubled each time")
    max_concurrency: int = Field(8, ge=1, le=1024, description="scoring requests in flight at once (all calls)")
    max_batch_rows: int = Field(64, ge=1, description="rows one score() call sends before waiting for them")
    top_k: int | None = Field(None, ge=1, le=1024, description="ask the server for this many top log-probs "
                              "(default: what each request asks for); must be >= the request's top_k")
    api_key_env: str | None = Field(None, description="environment variable holding the server's API key "
                                    "(SGLang --api-key); read at start-up, never logged")
    auth_header: str = Field("Authorization", description="header carrying the key; 'Authorization' sends "
                             "'Bearer <key>', any other header the bare key")
    tokenizer: str | None = Field(None, description="the served model's tokenizer (file or dir) for the "
                                  "start-up id check; default: ask the server (/v1/tokenize)")
    vocab_size: int | None = Field(None, ge=1, description="the served tokenizer's size, for servers that do "
                                   "not report tokenizer_vocab_size in /get_model_info (real SGLang)")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https:// (got {value!r})")
        return value.rstrip("/")
