"""Hugging Face causal-LM configs as megatron-core ``GPTModel``s (local, non-TransformerEngine
layer spec), and :class:`HFCausalLM`: a GPTModel answering the Hugging Face call the trainer's
forward passes make (``model(input_ids=..., logits_to_keep=mask) -> .logits``), so the same
loss code runs on Megatron's logits.

Supported ``model_type``: ``qwen3``, ``llama`` (dense, RMSNorm, SwiGLU, RoPE) and
``qwen3_moe`` (softmax top-k router, no shared experts, every layer sparse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from miles_engine.errors import ConfigError

SUPPORTED = ("qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """What the mapping and the parallel-size checks need from a HF config."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool
    experts: int = 0
    top_k: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shape_of(config: Any) -> ModelShape:
    c = text_config(config)
    mt = c.model_type
    if mt not in SUPPORTED:
        raise ConfigError(f"trainer.backend=megatron does not support model_type {mt!r}; supported: "
                          f"{', '.join(SUPPORTED)} (use trainer.backend=torch)")
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(f"trainer.backend=megatron: rope type {rope.get('rope_type')!r} of this {mt} model is "
                          f"not mapped (only the default RoPE); use trainer.backend=torch")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ConfigError(f"trainer.backend=megatron: {mt} with attention_bias/mlp_bias is not mapped")
    experts = 0
    if mt == "qwen3_moe":
        experts = int(c.num_experts)
        if list(getattr(c, "mlp_only_layers", []) or []) or int(getattr(c, "decoder_sparse_step", 1)) != 1:
            raise ConfigError("trainer.backend=megatron: qwen3_moe with dense layers (mlp_only_layers / "
                              "decoder_sparse_step != 1) is not mapped")
    heads = int(c.num_attention_heads)
    return ModelShape(model_type=mt, layers=int(c.num_hidden_layers), hidden=int(c.hidden_size), heads=heads,
                      kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                      head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
                      vocab=int(c.vocab_size), tied=bool(getattr(c, "tie_word_embeddings", False)),
                      qk_norm=mt in ("qwen3", "qwen3_moe"), experts=experts,
                      top_k=int(getattr(c, "num_experts_per_tok", 0) or 0))


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's vocab-parallel layers need a vocab divisible by TP: pad rows are zero and their
    logits are cut before any loss."""
    return -(-vocab // tp) * tp


def transformer_config(config: Any, *, tp: int = 1, pp: int = 1, ep: int = 1, sp: bool = False,
                       bf16: bool = False) -> Any:
    from megatron.core.transformer import TransformerConfig

    c = text_config(config)
    shape = shape_of(c)
    kwargs: dict[str, Any] = {}
    if shape.moe:
        kwargs.update(num_moe_experts=shape.experts, moe_ffn_hidden_size=int(c.moe_intermediate_size),
                      moe_router_topk=shape.top_k, moe_router_pre_softmax=not bool(c.norm_topk_prob),
                      moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                      moe_token_dispatcher_type="allgather",
                      moe_router_dtype="fp32")
    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=int(c.intermediate_size),
        normalization="RMSNorm", layernorm_epsilon=float(c.rms_norm_eps), gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=bf16, use_cpu_initialization=True, perform_initialization=False,
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        attention_softmax_in_fp32=True, sequence_parallel=sp and tp > 1, **kwargs)


def rope_base(config: Any) -> float:
    c = text_config(config)
    rope = getattr(c, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def build_gpt(config: Any, *, tp: int = 1, pp: int = 1, ep: int = 1, sp: bool = False, bf16: bool = False
              ) -> nn.Module:
    """A GPTModel for this rank's pipeline stage (parallel state must be initialised). ``sp``:
    sequence parallelism over the TP ranks (each holds 1/TP of the tokens between the attention and
    MLP blocks); the output layer then takes the gathered hidden states (see :class:`HFCausalLM`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    c = text_config(config)
    shape = shape_of(c)
    tcfg = transformer_config(c, tp=tp, pp=pp, ep=ep, sp=sp, bf16=bf16)
    if tcfg.sequence_parallel:
        from miles_engine.trainer.megatron.cpu_compat import torch_norm_with_sequence_parallel

        torch_norm_with_sequence_parallel()
    spec = get_gpt_layer_local_spec(num_experts=shape.experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    gpt = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=padded_vocab(shape.vocab, tp),
                   max_sequence_length=int(getattr(c, "max_position_embeddings", 4096)),
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope",
                   rotary_base=int(rope_base(c)), parallel_output=True)
    if tcfg.sequence_parallel and gpt.post_process:  # HFCausalLM gathers the sequence before the head
        gpt.output_layer.sequence_parallel = False
        gpt.output_layer.allreduce_dgrad = True
    if ep > 1:  # EP ranks hold different rows: token counts differ per rank
        from miles_engine.trainer.megatron.expert_parallel import pad_token_dispatch

        pad_token_dispatch(gpt)
    return gpt


class _Out:
    __slots__ = ("logits", "hidden_states")

    def __init__(self, logits: Tensor | None, hidden: Tensor) -> None:
        self.logits, self.hidden_states = logits, (hidden,)


class HFCausalLM(nn.Module):
    """A GPTModel (one pipeline stage of it) behind the Hugging Face causal-LM call.

    Rows are right-padded, so the causal mask alone is exact for every real token (padding only
    follows them); ``attention_mask`` is accepted and not needed. ``logits_to_keep`` (a boolean
    ``[rows, tokens]`` mask) runs the output layer only on those positions and returns
    ``[kept, vocab]``. Logits are gathered over TP (full vocab, padding rows cut).
    Pipeline stages: a stage that is not the first takes its input from :meth:`set_stage_input`
    (``[tokens, rows, hidden]``); a stage that is not the last returns ``_Out(None, hidden)``."""

    def __init__(self, gpt: nn.Module, hf_config: Any) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = hf_config
        self.vocab_size = int(text_config(hf_config).vocab_size)
        self._stage_input: Tensor | None = None

    @property
    def pre_process(self) -> bool:
        return bool(self.gpt.pre_process)

    @property
    def post_process(self) -> bool:
        return bool(self.gpt.post_process)

    def set_stage_input(self, hidden: Tensor | None) -> None:
        self._stage_input = hidden

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, output_hidden_states: bool = False,
                use_cache: bool = False, logits_to_keep: Tensor | None = None, **_: Any) -> _Out:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        gpt = self.gpt
        rows, width = input_ids.shape
        sp = gpt.config.sequence_parallel
        if sp:  # the sequence splits evenly over TP: right padding (causal: real tokens never see it)
            tp = gpt.config.tensor_model_parallel_size
            full = -(-width // tp) * tp
            input_ids = torch.nn.functional.pad(input_ids, (0, full - width))
        if gpt.pre_process:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand(rows, -1)
            hidden = gpt.embedding(input_ids=input_ids, position_ids=pos)  # [s, b, h]
        else:
            if self._stage_input is None:
                raise RuntimeError("a later pipeline stage needs set_stage_input() before its forward")
            hidden = self._stage_input
        gpt.decoder.set_input_tensor(None if gpt.pre_process else hidden)
        rotary = gpt.rotary_pos_emb(input_ids.shape[1])
        hidden = gpt.decoder(hidden_states=hidden if gpt.pre_process else None, attention_mask=None,
                             rotary_pos_emb=rotary)
        if not gpt.post_process:
            return _Out(None, hidden)
        if sp:  # [s/tp, b, h] -> [s, b, h]; backward: this rank's slice of the (all-reduced) gradient
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)[:width]
        bsh = hidden.transpose(0, 1)  # [b, s, h], after the final norm (like HF's hidden_states[-1])
        if isinstance(logits_to_keep, Tensor) and logits_to_keep.dtype == torch.bool:
            head_in = bsh[logits_to_keep].unsqueeze(1)  # [kept, 1, h]
        else:
            head_in = hidden
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(head_in, weight=weight)
        logits = gather_from_tensor_model_parallel_region(logits)[..., : self.vocab_size]
        logits = logits.squeeze(1) if head_in is not hidden else logits.transpose(0, 1)
        return _Out(logits, bsh if output_hidden_states else hidden)
