"""Hugging Face <-> megatron-core weight names and layouts (pure tensor code, no Megatron import).

Per decoder layer (HF ``model.layers.{i}.`` -> Megatron ``decoder.layers.{i - stage offset}.``):

- ``self_attn.{q,k,v}_proj`` -> ``self_attention.linear_qkv``: fused per query group,
  ``[group][q heads of the group, k, v][head_dim]`` rows; TP shards whole groups.
- ``self_attn.o_proj`` -> ``self_attention.linear_proj`` (TP: columns).
- ``self_attn.{q,k}_norm`` -> ``self_attention.{q,k}_layernorm`` (replicated).
- ``mlp.{gate,up}_proj`` -> ``mlp.linear_fc1`` = ``[gate; up]`` (TP: each rank ``[gate_r; up_r]``);
  ``mlp.down_proj`` -> ``mlp.linear_fc2`` (TP: columns).
- MoE: ``mlp.gate`` -> ``mlp.router``; ``mlp.experts.gate_up_proj[e]`` (``[gate; up]``) and
  ``down_proj[e]`` -> ``mlp.experts.local_experts.{e - ep offset}.linear_fc{1,2}`` (expert TP like
  the dense MLP).
- ``input_layernorm`` -> ``input_layernorm``; ``post_attention_layernorm`` -> ``pre_mlp_layernorm``.

Outside the layers: ``model.embed_tokens`` -> ``embedding.word_embeddings`` (first stage),
``model.norm`` -> ``decoder.final_layernorm`` and ``lm_head`` -> ``output_layer`` (last stage;
absent when embeddings are tied). Vocab rows are padded to a multiple of TP (zeros) and cut on
the way back. Megatron -> HF goes through *pieces*: each rank turns its shards into slices of
HF tensors (:func:`to_hf_pieces`), and :func:`merge_pieces` concatenates them in rank order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_engine.trainer.megatron.gpt import ModelShape, padded_vocab


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits: tensor (dense), expert tensor, expert and pipeline parallel coordinates."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    @property
    def pre(self) -> bool:
        return self.pp_rank == 0

    @property
    def post(self) -> bool:
        return self.pp_rank == self.pp - 1

    def layers(self, total: int) -> range:
        n = total // self.pp
        return range(self.pp_rank * n, (self.pp_rank + 1) * n)


@dataclass(frozen=True)
class Piece:
    """A slice of the HF tensor ``name``: ``index`` orders slices along ``dim`` (``None``: the
    whole tensor, identical on every rank that holds it)."""

    name: str
    tensor: Tensor
    dim: int | None = None
    index: int = 0


def _chunk(t: Tensor, parts: int, rank: int, dim: int = 0) -> Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"cannot split {tuple(t.shape)} into {parts} along dim {dim}")
    return t.chunk(parts, dim=dim)[rank].clone()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, s: ModelShape) -> Tensor:
    hpg, d = s.heads // s.kv_heads, s.head_dim
    h = q.shape[-1]
    qg = q.reshape(s.kv_heads, hpg * d, h)
    return torch.cat([qg, k.reshape(s.kv_heads, d, h), v.reshape(s.kv_heads, d, h)], dim=1).reshape(-1, h)


def _split_qkv(qkv: Tensor, s: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    hpg, d = s.heads // s.kv_heads, s.head_dim
    h = qkv.shape[-1]
    g = qkv.reshape(-1, (hpg + 2) * d, h)
    return (g[:, : hpg * d].reshape(-1, h), g[:, hpg * d: (hpg + 1) * d].reshape(-1, h),
            g[:, (hpg + 1) * d:].reshape(-1, h))


def _gated(gate: Tensor, up: Tensor, parts: int, rank: int) -> Tensor:
    return torch.cat([_chunk(gate, parts, rank), _chunk(up, parts, rank)], dim=0)


def to_megatron(hf: Mapping[str, Tensor], s: ModelShape, r: RankLayout = RankLayout()) -> dict[str, Tensor]:
    """This rank's Megatron parameters (names as ``GPTModel.named_parameters()``) from a full HF
    state dict."""
    out: dict[str, Tensor] = {}
    vp = padded_vocab(s.vocab, r.tp)
    if r.pre:
        out["embedding.word_embeddings.weight"] = _chunk(_pad_rows(hf["model.embed_tokens.weight"], vp), r.tp,
                                                         r.tp_rank)
    if r.post:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not s.tied:
            out["output_layer.weight"] = _chunk(_pad_rows(hf["lm_head.weight"], vp), r.tp, r.tp_rank)
        elif not r.pre:  # tied across pipeline stages: the last stage keeps a copy (grads summed with the first)
            out["output_layer.weight"] = _chunk(_pad_rows(hf["model.embed_tokens.weight"], vp), r.tp, r.tp_rank)
    for local, i in enumerate(r.layers(s.layers)):
        a, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        qkv = _fuse_qkv(hf[a + "self_attn.q_proj.weight"], hf[a + "self_attn.k_proj.weight"],
                        hf[a + "self_attn.v_proj.weight"], s)
        out[m + "self_attention.linear_qkv.weight"] = _chunk(qkv, r.tp, r.tp_rank)
        out[m + "self_attention.linear_proj.weight"] = _chunk(hf[a + "self_attn.o_proj.weight"], r.tp, r.tp_rank, 1)
        if s.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "self_attn.k_norm.weight"].clone()
        out[m + "input_layernorm.weight"] = hf[a + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[a + "post_attention_layernorm.weight"].clone()
        if s.moe:
            out[m + "mlp.router.weight"] = hf[a + "mlp.gate.weight"].clone()
            gate_up, down = hf[a + "mlp.experts.gate_up_proj"], hf[a + "mlp.experts.down_proj"]
            per = s.experts // r.ep
            for le in range(per):
                e = r.ep_rank * per + le
                gate, up = gate_up[e].chunk(2, dim=0)
                x = m + f"mlp.experts.local_experts.{le}."
                out[x + "linear_fc1.weight"] = _gated(gate, up, r.etp, r.etp_rank)
                out[x + "linear_fc2.weight"] = _chunk(down[e], r.etp, r.etp_rank, 1)
        else:
            out[m + "mlp.linear_fc1.weight"] = _gated(hf[a + "mlp.gate_proj.weight"], hf[a + "mlp.up_proj.weight"],
                                                      r.tp, r.tp_rank)
            out[m + "mlp.linear_fc2.weight"] = _chunk(hf[a + "mlp.down_proj.weight"], r.tp, r.tp_rank, 1)
    return out


def to_hf_pieces(local: Mapping[str, Tensor], s: ModelShape, r: RankLayout = RankLayout()) -> list[Piece]:
    """This rank's Megatron tensors (parameters, or anything shaped like them: gradients, Adam
    moments) as slices of HF tensors. Replicated tensors come only from the rank that owns them
    (TP rank 0; expert TP rank 0), so merging never sees duplicates."""
    pieces: list[Piece] = []
    lead = r.tp_rank == 0

    def whole(name: str, t: Tensor, owner: bool = lead) -> None:
        if owner:
            pieces.append(Piece(name, t.detach().clone()))

    if r.pre:
        pieces.append(Piece("model.embed_tokens.weight", local["embedding.word_embeddings.weight"].detach().clone(),
                            0, r.tp_rank))
    if r.post:
        whole("model.norm.weight", local["decoder.final_layernorm.weight"])
        if not s.tied:
            pieces.append(Piece("lm_head.weight", local["output_layer.weight"].detach().clone(), 0, r.tp_rank))
    for local_i, i in enumerate(r.layers(s.layers)):
        a, m = f"model.layers.{i}.", f"decoder.layers.{local_i}."
        q, k, v = _split_qkv(local[m + "self_attention.linear_qkv.weight"].detach(), s)
        for n, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            pieces.append(Piece(a + f"self_attn.{n}.weight", t.clone(), 0, r.tp_rank))
        pieces.append(Piece(a + "self_attn.o_proj.weight", local[m + "self_attention.linear_proj.weight"].detach()
                            .clone(), 1, r.tp_rank))
        if s.qk_norm:
            whole(a + "self_attn.q_norm.weight", local[m + "self_attention.q_layernorm.weight"])
            whole(a + "self_attn.k_norm.weight", local[m + "self_attention.k_layernorm.weight"])
        whole(a + "input_layernorm.weight", local[m + "input_layernorm.weight"])
        whole(a + "post_attention_layernorm.weight", local[m + "pre_mlp_layernorm.weight"])
        if s.moe:
            whole(a + "mlp.gate.weight", local[m + "mlp.router.weight"], lead and r.ep_rank == 0)
            per = s.experts // r.ep
            for le in range(per):
                e = r.ep_rank * per + le
                x = m + f"mlp.experts.local_experts.{le}."
                gate, up = local[x + "linear_fc1.weight"].detach().chunk(2, dim=0)
                pieces += [Piece(a + f"mlp.experts.{e}.gate", gate.clone(), 0, r.etp_rank),
                           Piece(a + f"mlp.experts.{e}.up", up.clone(), 0, r.etp_rank),
                           Piece(a + f"mlp.experts.{e}.down", local[x + "linear_fc2.weight"].detach().clone(), 1,
                                 r.etp_rank)]
        else:
            gate, up = local[m + "mlp.linear_fc1.weight"].detach().chunk(2, dim=0)
            pieces += [Piece(a + "mlp.gate_proj.weight", gate.clone(), 0, r.tp_rank),
                       Piece(a + "mlp.up_proj.weight", up.clone(), 0, r.tp_rank),
                       Piece(a + "mlp.down_proj.weight", local[m + "mlp.linear_fc2.weight"].detach().clone(), 1,
                             r.tp_rank)]
    return pieces


def hf_names(s: ModelShape) -> list[str]:
    """HF state-dict names in the order ``AutoModelForCausalLM.state_dict()`` lists them."""
    names = ["model.embed_tokens.weight"]
    for i in range(s.layers):
        a = f"model.layers.{i}."
        names += [a + f"self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [a + "self_attn.q_norm.weight", a + "self_attn.k_norm.weight"] if s.qk_norm else []
        if s.moe:
            names += [a + "mlp.experts.gate_up_proj", a + "mlp.experts.down_proj", a + "mlp.gate.weight"]
        else:
            names += [a + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [a + "input_layernorm.weight", a + "post_attention_layernorm.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def merge_pieces(pieces: Iterable[Piece], s: ModelShape) -> dict[str, Tensor]:
    """Full HF tensors from every rank's pieces, in HF state-dict order (tied: ``lm_head.weight``
    is the embedding, as in the HF state dict)."""
    by_name: dict[str, list[Piece]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    full: dict[str, Tensor] = {}
    for name, ps in by_name.items():
        if ps[0].dim is None:
            full[name] = ps[0].tensor
        else:
            ps = sorted(ps, key=lambda p: p.index)
            if [p.index for p in ps] != list(range(len(ps))):
                raise ValueError(f"{name}: shards {[p.index for p in ps]} are not 0..{len(ps) - 1}")
            full[name] = torch.cat([p.tensor for p in ps], dim=ps[0].dim)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in full:
            full[name] = full[name][: s.vocab]
    if s.tied:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    if s.moe:
        for i in range(s.layers):
            a = f"model.layers.{i}.mlp.experts."
            full[a + "gate_up_proj"] = torch.stack([torch.cat([full.pop(f"{a}{e}.gate"), full.pop(f"{a}{e}.up")])
                                                    for e in range(s.experts)])
            full[a + "down_proj"] = torch.stack([full.pop(f"{a}{e}.down") for e in range(s.experts)])
    missing = [n for n in hf_names(s) if n not in full]
    if missing:
        raise ValueError(f"merging Megatron shards left HF tensors missing: {missing[:5]}")
    return {n: full[n] for n in hf_names(s)}
