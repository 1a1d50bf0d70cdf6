"""Every bad input is a clear EngineRequestError, and the engine keeps serving."""

from __future__ import annotations

import pytest

from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.errors import EngineRequestError, MilesError

from .helpers import engine, greedy, prompt, req, run

CASES = [
    (dict(input_ids=[1, 2, 512]), "out of vocabulary"),
    (dict(input_ids=[-1, 2]), "out of vocabulary"),
    (dict(input_ids=[1, 2.5]), "not an integer"),
    (dict(input_ids=["a"]), "not an integer"),
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=list(range(64))), "does not fit the context"),
    (dict(input_ids=[1, 2], sampling={"max_new_tokens": 0}), "max_new_tokens"),
    (dict(input_ids=[1, 2], sampling=SamplingParams.model_construct(max_new_tokens=-3)), "max_new_tokens"),
    (dict(input_ids=[1, 2], sampling={"temperature": 0, "min_p": 0.1}), "min_p"),
    (dict(input_ids=[1, 2], sampling={"top_p": 0.0}), "top_p"),
    (dict(input_ids=[1, 2], sampling={"temperature": -1}), "temperature"),
    (dict(input_ids=[1, 2], sampling=[("temperature", 0)]), "SamplingParams or a dict"),
    (dict(input_ids=[1, 2], return_routed_experts=True), "dense"),
]


@pytest.mark.parametrize("fields,words", CASES, ids=[c[1] for c in CASES])
def test_bad_request_is_refused_and_engine_keeps_serving(fields: dict, words: str) -> None:
    async def main() -> None:
        eng = engine(max_context=64)
        with pytest.raises(EngineRequestError, match=words) as info:
            await eng.generate(GenerateRequest(**fields))
        assert isinstance(info.value, MilesError) and isinstance(info.value, ValueError)
        res = await eng.generate(req(prompt(5, 0), greedy(4)))
        assert len(res.output_ids) == 4 and await eng.health()
        await eng.aclose()

    run(main())


def test_dict_sampling_is_accepted_and_bad_pause_mode_refused() -> None:
    async def main() -> None:
        eng = engine()
        res = await eng.generate(GenerateRequest(input_ids=[1, 2, 3], sampling={"temperature": 0, "max_new_tokens": 3}))
        assert len(res.output_ids) == 3
        with pytest.raises(EngineRequestError, match="pause mode"):
            await eng.pause("sideways")  # type: ignore[arg-type]
        assert len((await eng.generate(req([1, 2, 3], greedy(2)))).output_ids) == 2
        await eng.aclose()

    run(main())
