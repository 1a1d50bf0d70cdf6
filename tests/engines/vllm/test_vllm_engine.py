"""A real vLLM (the CPU build, in its own environment: ``./dev.sh vllm``) as an engine kind, on the
real SmolLM2-135M: one server start for the whole module (a start costs about a minute here), the
steps in order.

1. Tokens in, tokens out: token-id prompts, sampled ids with their log-probs (after temperature, as
   the protocol asks: checked against the model's own log-softmax), stop on our ids, the version.
2. TITO sessions over it, driven by the OpenAI SDK with tool calls: one exact trajectory, sampled ids
   equal to the API's, no non-assistant mismatch.
3. Weights into it through the broadcast transport (vLLM's weight-transfer API, the bridge's gloo
   backend) under check-weight-update-equal: every tensor read back equal; a corrupted one named.
   A push while a request decodes: the request continues on the new weights, each token with the
   version that sampled it; a caller's abort ends a request.
4. SIGKILL of the server: restarted with the last pushed weights at their version, the request in
   flight retried.
"""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import torch

from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.fleet.vllm_kind import VllmKind
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.vllm.options import VllmKindOptions
from tests.engines.vllm.helpers import GGUF, IM_END, VLLM_MARKS

openai = pytest.importorskip("openai")
pytestmark = VLLM_MARKS
LONG = 192  # the request a push meets while it decodes
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from miles_engine.models.loading import load_model

    model, _ = load_model(str(GGUF), dtype="float32")
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    model.save_pretrained(str(out), safe_serialization=True)
    return out, model


def _trainer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


async def _tokens_in_tokens_out(engine, model) -> None:
    from miles_engine.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(GGUF))
    prompt = tok.encode("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n")
    result = await engine.generate(GenerateRequest(prompt, SamplingParams(temperature=0.7, max_new_tokens=12,
                                                                          stop_token_ids=(IM_END,), seed=3)))
    assert 1 <= len(result.output_ids) <= 12 and len(result.output_logprobs) == len(result.output_ids)
    assert result.weight_versions == [0] * len(result.output_ids)
    assert result.finish_reason in ("stop", "length") and result.prompt_tokens == len(prompt)
    if result.finish_reason == "stop":
        assert result.output_ids[-1] == IM_END
    # the log-probs are the sampling distribution's (temperature 0.7), as the model computes it
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
    assert result.output_logprobs == pytest.approx(expected.tolist(), abs=2e-3)


async def _tito_sessions(engine) -> None:
    from miles_engine.hub import default_hub
    from miles_engine.models.tokenizer import load_tokenizer
    from miles_engine.tito import make_codec
    from miles_engine.tito.server import create_app
    from miles_engine.tito.service import SessionManager, SessionServerConfig

    tok = load_tokenizer(str(GGUF))
    manager = SessionManager(engine, make_codec("chatml", tok, hub=default_hub()), SessionServerConfig(mode="linear"))
    transport = httpx.ASGITransport(app=create_app(manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://tito", timeout=600) as http:
        session = (await http.post("/sessions", json={"mode": "linear"})).json()
        client = openai.AsyncOpenAI(base_url=f"http://tito/sessions/{session['session_id']}/v1", api_key="k",
                                    http_client=http, max_retries=0)
        messages: list[dict] = [{"role": "system", "content": "You are a shell agent."},
                                {"role": "user", "content": "List the files in /tmp."}]
        api_tokens = []
        for turn in range(3):
            resp = await client.chat.completions.create(model="policy", messages=messages, tools=[BASH],
                                                        temperature=0.8, max_tokens=24, seed=turn, logprobs=True)
            choice = resp.choices[0]
            api_tokens.append([(t.token, t.logprob) for t in choice.logprobs.content])
            msg = choice.message.model_dump(exclude_none=True)
            messages.append(msg)
            for i, call in enumerate(msg.get("tool_calls") or []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"a.txt\nb{i}.txt\n"})
            if not msg.get("tool_calls"):
                messages.append({"role": "user", "content": "Now count them."})
        report = (await http.get(f"/sessions/{session['session_id']}/trajectories")).json()
    assert len(report["trajectories"]) == 1
    traj = report["trajectories"][0]
    row, mask, lps = traj["token_ids"], traj["loss_mask"], traj["rollout_logprobs"]
    assert len(traj["turns"]) == 3
    for turn, tokens in zip(traj["turns"], api_tokens):
        s, e = turn["completion_start"], turn["completion_end"]
        assert all(mask[s:e]) and not any(mask[turn["prompt_start"]:s])
        assert [tok.piece(t) for t in row[s:s + len(tokens)]] == [t for t, _ in tokens]
        assert lps[s:s + len(tokens)] == pytest.approx([lp for _, lp in tokens], abs=1e-6)
    assert report["metrics"]["tito_session_mismatch_rate/non_assistant_text"] == 0.0


def _checked_transport(engine):
    from miles_engine.weights.broadcast import BroadcastTransport
    from miles_engine.weights.check.transport import CheckedTransport

    return CheckedTransport(BroadcastTransport([engine], backend="gloo", bucket_bytes=64 << 20), [engine])


async def _decoding(engine, request_id: str) -> None:
    """Until vLLM itself reports the request running and decoding (its /metrics), bounded: what the
    test does next must meet the request in the engine, however fast or slow this machine is."""
    import httpx

    def gauge(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    async with httpx.AsyncClient(base_url=engine.client.base_url, timeout=10) as http:
        for _ in range(2400):
            if request_id in engine.client._wire_ids:
                text = (await http.get("/metrics")).text
                if gauge(text, "vllm:num_requests_running") >= 1:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError(f"request {request_id} never ran in vLLM")


def test_vllm_engine_tokens_sessions_weights_and_restart(smollm2, tmp_path: Path) -> None:
    model_dir, model = smollm2
    trainer = {"weights": _trainer_weights(model), "version": 0}

    async def restore():
        return trainer["weights"], trainer["version"]

    async def main() -> None:
        kind = VllmKind(VllmKindOptions(cpu_kv_cache_gib=1, max_model_len=2048, start_timeout_s=900))
        ctx = FleetContext(model=str(model_dir), state_dir=tmp_path / "engines", seed=0, restore=restore)
        async with AsyncExitStack() as stack:
            [engine] = await kind.start(EngineGroupConfig(kind="vllm"), "vllm", ctx, stack)
            assert engine.weight_version == 0 and {m.name for m in engine.weight_metadata()} >= set(trainer["weights"])

            await _tokens_in_tokens_out(engine, model)
            await _tito_sessions(engine)

            # 3. a new version through vLLM's weight-transfer API, every tensor read back equal
            gen = torch.Generator().manual_seed(0)
            new = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in trainer["weights"].items()}
            pusher = _checked_transport(engine)  # kept: its group is built, so a later push pauses at once
            stack.push_async_callback(pusher.close)
            await pusher.push(list(new.items()), 1)
            trainer.update(weights=new, version=1)
            assert await engine.fetch_weight_version() == 1
            sums = await engine.weight_checksums(["model.layers.0.self_attn.k_proj.weight"])
            from miles_engine.weights.tensors import digest

            assert sums == {"model.layers.0.self_attn.k_proj.weight": digest(new["model.layers.0.self_attn.k_proj.weight"])}
            result = await engine.generate(GenerateRequest([1, 4093, 198, 6004], SamplingParams(max_new_tokens=4)))
            assert result.weight_versions == [1] * len(result.output_ids)

            # a tensor that differs from the trainer's is named
            from miles_engine.weights.check.errors import WeightCheckError
            from miles_engine.weights.check.transport import CheckedTransport

            bad = dict(new)
            bad["model.layers.3.mlp.up_proj.weight"] = new["model.layers.3.mlp.up_proj.weight"] + 1.0
            from miles_engine.weights.broadcast import BroadcastTransport

            checker = CheckedTransport(BroadcastTransport([engine], backend="gloo"), [engine])
            with pytest.raises(WeightCheckError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
                await checker.check(bad, 1)
            await checker.close()

            # a push while a request decodes: vLLM aborts it at the pause, the client sends it again after
            # the resume with its tokens so far, so its tokens say which weights sampled them
            # (192 tokens: ~20 s of decoding here, and the pause comes within a /metrics poll of the start)
            long = asyncio.ensure_future(engine.generate(GenerateRequest(
                [1, 4093, 198, 6004, 665], SamplingParams(max_new_tokens=LONG, temperature=1.0), request_id="long")))
            await _decoding(engine, "long")
            newer = {n: t + 0.001 for n, t in new.items()}
            await pusher.push(list(newer.items()), 2)
            result = await asyncio.wait_for(long, 900)
            assert len(result.output_ids) == LONG and result.finish_reason == "length"
            # re-sent after the resume (it was in vLLM at the pause); the tokens before it, if any, are v1
            assert result.info["segments"] >= 2 and result.weight_versions[-1] == 2
            assert result.weight_versions == sorted(result.weight_versions) and set(result.weight_versions) <= {1, 2}
            await pusher.push(list(new.items()), 3)  # back to the weights the restart test checks (at version 3)
            trainer.update(weights=new, version=3)
            # a caller's abort ends the request with what it has, never re-sent
            doomed = asyncio.ensure_future(engine.generate(GenerateRequest(
                [1, 4093, 198], SamplingParams(max_new_tokens=512), request_id="doomed")))
            await _decoding(engine, "doomed")
            assert await engine.abort("doomed")
            result = await asyncio.wait_for(doomed, 120)
            assert result.finish_reason == "abort" and len(result.output_ids) < 512

            # 4. SIGKILL: the request in flight is retried on the restarted server, at its version
            pid = int(engine.process.pid)
            pending = asyncio.ensure_future(engine.generate(GenerateRequest(
                [1, 4093, 198, 6004, 665], SamplingParams(max_new_tokens=32, temperature=1.0))))
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            result = await asyncio.wait_for(pending, 900)
            assert engine.restarts == 1 and result.info["retries"] >= 1
            assert result.weight_versions and set(result.weight_versions) == {3}
            assert await engine.fetch_weight_version() == 3
            sums = await engine.weight_checksums()
            assert all(sums[n] == digest(t) for n, t in new.items()), "the restarted server lost the pushed weights"

    asyncio.run(main())
