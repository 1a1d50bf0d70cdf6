"""HF <-> Megatron weight mapping without megatron-core (pure tensor code): every layout of
TP / PP / EP / expert-TP shards merges back bit exact; and the parallel-size checks."""

from __future__ import annotations

import pytest
import torch

from miles_engine.models.loading import load_model
from miles_engine.errors import ConfigError
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.megatron import hf_mapping as hm
from miles_engine.trainer.megatron.config import MegatronConfig
from miles_engine.trainer.megatron.gpt import shape_of
from miles_engine.trainer.megatron.proxy import model_shape

torch.set_num_threads(1)

MODELS = ["tiny:qwen3", "tiny:qwen3,tie_word_embeddings=true,vocab_size=511", "tiny:llama",
          "tiny:qwen3_moe", "tiny:qwen3_moe,norm_topk_prob=true,tie_word_embeddings=true"]


def _layouts(tp: int, pp: int, ep: int, etp: int) -> list[hm.RankLayout]:
    return [hm.RankLayout(tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e, etp=etp, etp_rank=x)
            for t in range(tp) for p in range(pp) for e in range(ep) for x in range(etp)
            if etp == 1 or x == t]  # expert TP rides on the TP ranks


@pytest.mark.parametrize("spec", MODELS)
def test_every_shard_layout_round_trips_bit_exact(spec: str) -> None:
    hf, _ = load_model(spec, seed=3)
    state = hf.state_dict()
    shape = shape_of(hf.config)
    assert hm.hf_names(shape) == list(state)  # the HF state-dict order, tied lm_head included
    sizes = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 1), (2, 2, 1, 2)]  # expert TP = TP (Megatron's default)
    if shape.moe:
        sizes += [(1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 4, 1), (2, 1, 2, 2)]
    for tp, pp, ep, etp in sizes:
        pieces = []
        for layout in _layouts(tp, pp, ep, etp):
            local = hm.to_megatron(state, shape, layout)
            if tp > 1:  # really a shard: fused QKV rows of this rank's query groups only
                qkv = local["decoder.layers.0.self_attention.linear_qkv.weight"] if layout.pre else None
                assert qkv is None or qkv.shape[0] == (shape.heads + 2 * shape.kv_heads) * shape.head_dim // tp
            # one copy of each: dense pieces from EP rank 0, experts replicated over TP from TP rank 0
            pieces += [p for p in hm.to_hf_pieces(local, shape, layout)
                       if (".mlp.experts." in p.name and (etp > 1 or layout.tp_rank == 0))
                       or (".mlp.experts." not in p.name and layout.ep_rank == 0)]
        back = hm.merge_pieces(pieces, shape)
        assert list(back) == list(state), (tp, pp, ep)
        bad = [k for k in state if not torch.equal(back[k], state[k])]
        assert bad == [], (spec, tp, pp, ep, etp, bad[:3])


def test_fused_layouts_are_megatrons() -> None:
    """linear_qkv is [group][q heads, k, v] and linear_fc1 is [gate; up] (what the local spec's
    attention and gated MLP read)."""
    hf, _ = load_model("tiny:qwen3", seed=0)
    s = hf.state_dict()
    shape = shape_of(hf.config)
    m = hm.to_megatron(s, shape)
    qkv = m["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, hpg = shape.head_dim, shape.heads // shape.kv_heads
    group1 = qkv[(hpg + 2) * d: 2 * (hpg + 2) * d]
    assert torch.equal(group1[: hpg * d], s["model.layers.0.self_attn.q_proj.weight"][hpg * d: 2 * hpg * d])
    assert torch.equal(group1[hpg * d: (hpg + 1) * d], s["model.layers.0.self_attn.k_proj.weight"][d: 2 * d])
    fc1 = m["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([s["model.layers.0.mlp.gate_proj.weight"], s["model.layers.0.mlp.up_proj.weight"]]))


def test_bad_parallel_sizes_are_one_clear_error() -> None:
    shape = model_shape("tiny:qwen3")  # 4 heads, 2 kv heads, 2 layers, dense
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 must divide the model's 4 attention heads and 2 "
                                          r"key/value heads"):
        MegatronConfig(tensor_parallel=4).check(4, shape)
    with pytest.raises(ConfigError, match=r"world size 3 \(trainer ranks\) is not a multiple of .*= 2 x 1"):
        MegatronConfig(tensor_parallel=2).check(3, shape)
    with pytest.raises(ConfigError, match="pipeline_parallel=4 must divide the model's 2 layers"):
        MegatronConfig(pipeline_parallel=4).check(4, shape)
    moe = model_shape("tiny:qwen3_moe")  # 4 experts
    assert MegatronConfig(expert_parallel=2).check(2, moe) == 2
    with pytest.raises(ConfigError, match="expert_parallel=3 must divide the model's 4 experts"):
        MegatronConfig(expert_parallel=3).check(3, moe)
    with pytest.raises(ConfigError, match="expert_parallel=2 needs a MoE model"):
        MegatronConfig(expert_parallel=2).check(2, shape)
    with pytest.raises(ConfigError, match="expert_parallel=2 with pipeline_parallel=2 is not supported"):
        MegatronConfig(expert_parallel=2, pipeline_parallel=2).check(4, moe)
    assert MegatronConfig(tensor_parallel=2, sequence_parallel=True).check(2, shape) == 1
    with pytest.raises(ConfigError, match=r"sequence_parallel=true needs tensor_parallel > 1 .*\(got 1 and 1\)"):
        MegatronConfig(sequence_parallel=True).check(2, shape)
    with pytest.raises(ConfigError, match="context_parallel=2 is not supported: .*Transformer Engine"):
        MegatronConfig(context_parallel=2).check(2, shape)
    assert MegatronConfig(tensor_parallel=2).check(4, shape) == 2  # the data-parallel size
    with pytest.raises(ConfigError, match=r"trainer\.backend"):
        TrainerConfig.load({"backend": "deepspeed"})
    with pytest.raises(ConfigError, match=r"trainer\.megatron\.tensor_paralel"):
        TrainerConfig.load({"backend": "megatron", "megatron": {"tensor_paralel": 2}})


def test_the_factory_refuses_bad_sizes_before_starting_any_rank() -> None:
    pytest.importorskip("megatron.core")
    from miles_engine.trainer.factory import create_trainer

    with pytest.raises(ConfigError, match="tensor_parallel=3 must divide"):
        create_trainer("tiny:qwen3", {"backend": "megatron", "megatron": {"tensor_parallel": 3}}, world_size=3)
    with pytest.raises(ConfigError, match=r"pipeline_parallel > 1 does not run a reference model"):
        create_trainer("tiny:qwen3", {"backend": "megatron", "megatron": {"pipeline_parallel": 2},
                                      "kl": {"reference": True}}, world_size=2)
    with pytest.raises(ConfigError, match="does not support model_type 'gpt2'"):
        shape_of(type("C", (), {"model_type": "gpt2"})())
