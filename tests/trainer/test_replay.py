"""R3: the trainer's MoE routers replay the experts the engine recorded at rollout."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer import BatchError, TorchTrainer
from miles_engine.trainer.replay import RoutingReplay, replay_rows

from .helpers import MOE, TINY


def test_replay_rows_shift_to_the_predicting_position() -> None:
    mask = [0, 0, 1, 1, 0, 1]
    per_token = [None, None, [[1, 2]], [[3, 0]], None, [[2, 3]]]
    rows = replay_rows(per_token, mask, 1, 2)
    assert rows[:, 0].tolist() == [[-1, -1], [1, 2], [3, 0], [-1, -1], [2, 3], [-1, -1]]
    assert torch.equal(replay_rows([[[1, 2]], [[3, 0]], [[2, 3]]], mask, 1, 2), rows)  # compact form
    assert replay_rows(None, mask, 1, 2) is None


def test_replay_forces_experts_and_keeps_router_gradients() -> None:
    tr = TorchTrainer(MOE, {"algorithm": {"routing_replay": True}})
    replay: RoutingReplay = tr.replay
    assert tr.routing == (2, 2, 4)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    base = tr.policy(input_ids=ids).logits
    own = torch.stack([r.reshape(2, 7, 2) for r in replay.last], dim=2)  # [b, t, layers, k]
    replay.set(own)
    assert torch.allclose(tr.policy(input_ids=ids).logits, base, atol=1e-6)  # own routing: no change
    forced = torch.full_like(own, -1)
    forced[:, 3:] = own[:, 3:].flip(-1).remainder(4).add(1).remainder(4)  # different experts from position 3
    forced[:, 3:, :, 1] = (forced[:, 3:, :, 0] + 1) % 4
    replay.set(forced)
    out = tr.policy(input_ids=ids).logits
    assert torch.equal(torch.stack([r.reshape(2, 7, 2) for r in replay.last], 2)[:, 3:], forced[:, 3:])
    assert torch.allclose(out[:, :3], base[:, :3], atol=1e-6) and not torch.allclose(out[:, 3:], base[:, 3:])
    out.float().logsumexp(-1).sum().backward()
    gates = [p for n, p in tr.policy.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == 2 and all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)
    replay.set(None)


def test_engine_routes_replayed_in_training() -> None:
    from miles_engine.engines.embedded.engine import EmbeddedEngine
    from miles_engine.engines.protocol import GenerateRequest, SamplingParams

    tr = TorchTrainer(MOE, {"algorithm": {"routing_replay": True}, "mismatch": {"mode": "tis"},
                            "max_tokens_per_micro_batch": 32})
    eng = EmbeddedEngine.from_model(tr.policy, num_threads=1, max_context=128)
    prompt = [5, 9, 13, 200]

    async def rollout() -> list:
        try:
            return await asyncio.gather(*[eng.generate(GenerateRequest(
                input_ids=prompt, sampling=SamplingParams(temperature=1.0, max_new_tokens=5, seed=j),
                return_routed_experts=True)) for j in range(4)])
        finally:
            await eng.aclose()

    results = asyncio.run(asyncio.wait_for(rollout(), 60))
    trajs = []
    for j, r in enumerate(results):
        per_token = [None] * len(prompt) + r.routed_experts  # the layout TITO assembles
        trajs.append(Trajectory(prompt + r.output_ids, [0] * 4 + [1] * 5, [0.0] * 4 + r.output_logprobs,
                                [None] * 4 + r.weight_versions, reward=float(j % 2), index=j,
                                routed_experts=per_token))
    m = tr.train_step([Group("g", "t", trajs, 0)])
    assert m["r3/replayed_fraction"] == 1.0
    # the engine's routes, replayed one position earlier, reproduce its log-probs exactly;
    # a misaligned replay would route through other experts and move them
    assert m["tis/logprob_abs_diff"] < 1e-5
    bad = [Trajectory(t.token_ids, t.loss_mask, t.rollout_logprobs, t.weight_versions, reward=t.reward,
                      index=t.index, routed_experts=[None] * 4 + [[[0, 9], [1, 2]]] * 5) for t in trajs]
    with pytest.raises(BatchError, match="expert ids in 0..3"):
        tr.train_step([Group("g", "t", bad, 0)])


def test_replay_refuses_dense_models() -> None:
    with pytest.raises(ValueError, match="no MoE routers"):
        TorchTrainer(TINY, {"algorithm": {"routing_replay": True}})
