"""A scripted judge model behind the real SGLang-compatible HTTP server of miles."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable

from miles_engine.engines.protocol import GenerateRequest, GenerateResult, TensorMeta
from miles_engine.hub import default_hub

TOKENIZER = "builtin:bpe-chatml"


@functools.cache
def codec():
    from miles_engine.tito import make_codec

    return make_codec("chatml", TOKENIZER, hub=default_hub())


class ScriptedJudgeModel:
    """A RolloutEngine whose answer is ``reply(prompt_text)``, tokenized: token ids in, token ids out."""

    def __init__(self, reply: Callable[[str], str]) -> None:
        self.reply = reply
        self.prompts: list[str] = []

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        c = codec()
        prompt = c.tokenizer.decode(list(request.input_ids))
        self.prompts.append(prompt)
        out = c.tokenizer.encode(self.reply(prompt))[: request.sampling.max_new_tokens - 1] + [c.stop_ids[0]]
        return GenerateResult(request.request_id, out, [-0.1] * len(out), [0] * len(out), "stop", len(request.input_ids))

    async def pause(self, mode: str = "retract") -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, request_id: str) -> bool:
        return False

    async def update_weights(self, weights, *, version=None) -> int:
        raise ValueError("a scripted judge has no weights")

    def weight_metadata(self) -> list[TensorMeta]:
        return []

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None: ...


def grade_paris(prompt: str) -> str:
    """A judge that knows one fact and answers in the requested format."""
    response = prompt.split("[Response]")[-1].split("[Rubric]")[0]
    return "The response is right.\nSCORE: 10" if "Paris" in response else "Wrong city.\nSCORE: 0"


@contextlib.asynccontextmanager
async def http_judge(model: ScriptedJudgeModel) -> AsyncIterator[str]:
    """Serve ``model`` on 127.0.0.1 with miles' SGLang-compatible server; yield its URL."""
    from miles_engine.run.engine_server import serve

    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(model, host="127.0.0.1", port=0, on_ready=ready.set_result))
    try:
        port = await asyncio.wait_for(ready, 20)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
