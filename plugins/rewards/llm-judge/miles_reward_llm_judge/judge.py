"""``llm-judge``: score an episode by asking a model, through any miles :class:`RolloutEngine`.

The judge renders a grading conversation with a chat family, tokenizes it, generates with the
engine (token ids in, token ids out, as every miles engine speaks), decodes the answer and reads
the verdict (:mod:`.verdict`). Engines:

- ``engine_url``: an SGLang-compatible ``/generate`` server — ``miles serve --model ...`` or a real
  SGLang server — through :class:`~miles_engine.engines.http.client.HttpEngine`;
- ``model``: an in-process embedded engine (a model directory, ``.gguf`` or ``tiny:`` spec);
- or an engine object handed to :class:`LLMJudge` directly (e.g. the run's own engine).

``tokenizer`` must be the judge model's (default: the model directory). The engine is created or
connected on first use and released by :meth:`LLMJudge.aclose`. An unreachable server, a failed
generation, a timeout or an unreadable verdict fail that episode's reward, naming the cause.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.errors import ConfigError
from miles_engine.rewards.protocol import describe_error
from miles_reward_llm_judge.verdict import VerdictError, parse_verdict

SYSTEM_PROMPT = "You are a strict, fair grader. You judge answers; you never solve the task yourself."
DEFAULT_TEMPLATE = """Grade the response to the task below.

[Task]
{question}

[Reference answer]
{reference}

[Response]
{response}

[Rubric]
{rubric}

Think briefly, then end with one line exactly of the form "SCORE: <integer from 0 to {scale}>"."""
DEFAULT_RUBRIC = "Full marks for a correct, complete answer that agrees with the reference; zero for a wrong one."
MAX_FIELD_CHARS = 8_000


class JudgeOptions(Section):
    engine_url: str | None = Field(None, description="SGLang-compatible server (miles serve / SGLang), e.g. "
                                                     "http://127.0.0.1:30000")
    model: str | None = Field(None, description="in-process embedded engine: model dir, .gguf or tiny: spec")
    tokenizer: str | None = Field(None, description="the judge model's tokenizer (default: the model directory)")
    chat_family: str = Field("chatml", description="chat family that renders the grading prompt")
    template: str = Field(DEFAULT_TEMPLATE, description="user message; {question} {response} {reference} "
                                                        "{rubric} {scale} are filled in")
    system_prompt: str = SYSTEM_PROMPT
    rubric: str = DEFAULT_RUBRIC
    reference_key: str = Field("answer", description="task metadata key of the reference (optional)")
    scale: float = Field(10.0, gt=0, description="the score the judge gives to a perfect response")
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    seed: int | None = 0
    timeout_s: float = Field(300.0, gt=0, description="deadline of one judgement")

    @model_validator(mode="after")
    def _one_engine(self) -> JudgeOptions:
        if (self.engine_url is None) == (self.model is None):
            raise ValueError("set exactly one of `engine_url` (an SGLang-compatible server) and `model` "
                             "(an in-process embedded engine)")
        if self.tokenizer is None and (self.engine_url is not None or str(self.model).startswith("tiny:")):
            raise ValueError("set `tokenizer` (the judge model's tokenizer: a model directory, tokenizer.json "
                             "or builtin: spec); it cannot be inferred from "
                             + ("an engine URL" if self.engine_url else "a tiny: spec"))
        for field in ("{response}",):
            if field not in self.template:
                raise ValueError(f"template must contain {field}")
        return self


def _text(value: Any) -> str:
    if value is None:
        return "(none)"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_FIELD_CHARS else text[:MAX_FIELD_CHARS // 2] + "\n…\n" + text[-MAX_FIELD_CHARS // 2:]


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def grading_fields(episode: EpisodeContext, reference_key: str) -> dict[str, str]:
    transcript = episode.transcript if isinstance(getattr(episode, "transcript", None), list) else []
    question = next((_message_text(m) for m in transcript if isinstance(m, dict) and m.get("role") == "user"), "")
    answers = [_message_text(m) for m in transcript if isinstance(m, dict) and m.get("role") == "assistant"]
    response = next((a for a in reversed(answers) if a.strip()), "")
    metadata = getattr(getattr(episode, "task", None), "metadata", None)
    reference = metadata.get(reference_key) if isinstance(metadata, dict) else None
    return {"question": _text(question or None), "response": _text(response or None), "reference": _text(reference)}


class LLMJudge:
    deterministic = False  # a model's verdict; greedy decoding makes it repeatable on one engine, not promised

    def __init__(self, options: JudgeOptions, *, hub: Any = None, engine: Any = None, codec: Any = None) -> None:
        """``hub``: the one that built this reward (it builds the judge's chat family); ``codec``
        instead: a ready one."""
        self.options = options
        self._hub = hub
        self._engine, self._codec = engine, codec
        self._owns_engine = engine is None
        self._lock = asyncio.Lock()

    @property
    def target(self) -> str:
        return self.options.engine_url or f"embedded engine ({self.options.model})"

    async def _ready(self) -> tuple[Any, Any]:
        async with self._lock:
            if self._codec is None:
                from miles_engine.tito import make_codec

                if self._hub is None:
                    raise ConfigError("the llm-judge reward builds its chat family through the hub that built it: "
                                      "create it with hub.create('reward', 'llm-judge', ...) (or pass codec=)")
                tok = self.options.tokenizer or self.options.model
                self._codec = await asyncio.to_thread(
                    lambda: make_codec(self.options.chat_family, tok, hub=self._hub))
            if self._engine is None:
                self._engine = await self._start_engine()
        return self._engine, self._codec

    async def _start_engine(self) -> Any:
        o = self.options
        if o.engine_url is not None:
            from miles_engine.engines.http.client import HttpEngine

            engine = HttpEngine(o.engine_url, retries=1, generate_timeout=o.timeout_s)
            try:
                return await engine.connect()
            except BaseException:
                await engine.aclose()
                raise
        from miles_engine.engines.embedded import EmbeddedEngine

        return await asyncio.to_thread(EmbeddedEngine.from_model, o.model, seed=o.seed or 0)

    def prompt(self, episode: EpisodeContext) -> list[dict[str, str]]:
        o = self.options
        fields = {**grading_fields(episode, o.reference_key), "rubric": o.rubric, "scale": f"{o.scale:g}"}
        user = o.template
        for key, value in fields.items():  # not str.format: answers may hold braces
            user = user.replace("{" + key + "}", value)
        return [{"role": "system", "content": o.system_prompt}, {"role": "user", "content": user}]

    async def judge_text(self, episode: EpisodeContext) -> str:
        engine, codec = await self._ready()
        o = self.options
        ids = codec.encode_conversation(self.prompt(episode), add_generation_prompt=True)
        request = GenerateRequest(ids, SamplingParams(temperature=o.temperature, max_new_tokens=o.max_new_tokens,
                                                      stop_token_ids=codec.stop_ids, seed=o.seed),
                                  return_logprob=False)
        result = await engine.generate(request)
        if result.finish_reason == "abort":
            raise RuntimeError("the engine aborted the judgement")
        return codec.tokenizer.decode(codec.strip_stop(result.output_ids), skip_special_tokens=True)

    async def score(self, episode: EpisodeContext) -> RewardResult:
        try:
            async with asyncio.timeout(self.options.timeout_s):
                text = await self.judge_text(episode)
        except TimeoutError:
            return RewardResult.failed(f"llm-judge at {self.target}: no verdict within {self.options.timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - an unreachable judge fails this reward, not the batch
            return RewardResult.failed(f"llm-judge at {self.target}: {describe_error(exc)}")
        try:
            reward, raw = parse_verdict(text, scale=self.options.scale)
        except VerdictError as exc:
            return RewardResult.failed(f"llm-judge at {self.target}: {exc}", verdict_text=text[-2000:])
        return RewardResult(reward=reward, components={"judge_score": raw}, info={"verdict_text": text[-2000:]})

    async def aclose(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None and self._owns_engine:
            await engine.aclose()
