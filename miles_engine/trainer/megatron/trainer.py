"""One Megatron rank: :class:`MegatronTrainer`, a :class:`TorchTrainer` whose policy (and
reference) is a megatron-core ``GPTModel`` shard behind the HF call (:class:`~.gpt.HFCausalLM`).

Everything between the batch and the loss is the torch backend's code (``rl_step``, the loss
functions, micro-batching, metrics); what differs is here: parallel state, weights in and out
through :mod:`.hf_mapping`, gradients averaged over the data-parallel group (dense and expert
parameters each over their own), the global gradient norm counted once per element (TP
duplicates skipped, summed over the model-parallel groups), and HF-named state dicts, so a
checkpoint moves between the torch and the Megatron backend.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from miles_engine.errors import ConfigError
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.megatron import cpu_compat, dist_checkpoint, pipeline, state
from miles_engine.trainer.megatron import hf_mapping as hm
from miles_engine.trainer.megatron.gpt import HFCausalLM, build_gpt, shape_of
from miles_engine.trainer.megatron.pipeline import last_stage_metrics, reduce_tied_embedding_grads
from miles_engine.trainer.models import ValueHead, build_causal_lm
from miles_engine.trainer.optim import build_optimizer
from miles_engine.trainer.optimizer_stream import all_resident, stream_state
from miles_engine.trainer.parallel import Local
from miles_engine.trainer.torch_trainer import _DTYPES, TorchTrainer


def init_parallel(cfg: TrainerConfig) -> None:
    """Megatron's parallel state over the (initialised) default process group, and its RNG."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_compat.enable()
    m = cfg.megatron
    m.check(dist.get_world_size())
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=m.tensor_parallel,
                                     pipeline_model_parallel_size=m.pipeline_parallel,
                                     expert_model_parallel_size=m.expert_parallel)
    model_parallel_cuda_manual_seed(cfg.seed)


def check_supported(cfg: TrainerConfig) -> None:
    """What the backend does not run yet, refused before any rank starts (one error)."""
    if cfg.algorithm.advantage_estimator == "ppo" and cfg.value.kind == "separate":
        raise ConfigError("trainer.backend=megatron supports the PPO value head (trainer.value.kind=head), "
                          "not a separate critic")
    if cfg.megatron.pipeline_parallel > 1 and (cfg.kl.reference or cfg.algorithm.advantage_estimator == "ppo"):
        raise ConfigError("trainer.megatron.pipeline_parallel > 1 does not run a reference model (kl.reference) "
                          "or the PPO value head yet; use pipeline_parallel=1 (tensor_parallel still applies)")


def rank_layout() -> hm.RankLayout:
    from megatron.core import parallel_state as ps

    return hm.RankLayout(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                         pp=ps.get_pipeline_model_parallel_world_size(),
                         pp_rank=ps.get_pipeline_model_parallel_rank(),
                         ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
                         etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank())


class MegatronComm(Local):
    """Metrics and token counts reduce over the data-parallel group (TP / PP peers hold the same rows)."""

    def __init__(self, device: torch.device) -> None:
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.device = device
        self.rank = ps.get_data_parallel_rank()
        self.world_size = ps.get_data_parallel_world_size()
        self.group = ps.get_data_parallel_group()

    def _reduce(self, t: Tensor, op: Any) -> Tensor:
        if self.world_size == 1:
            return t
        buf = t.detach().clone().to(self.device)
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

    def all_sum(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def all_max(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)

    def all_min(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.MIN)

    def close(self) -> None:
        self.ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _tp_partial(name: str, sequence_parallel: bool) -> bool:
    """Replicated over TP but each TP rank's gradient is partial: the q/k norms (they act on this
    rank's heads only) and, with sequence parallelism, every norm and the MoE router (they see this
    rank's tokens only)."""
    if "q_layernorm" in name or "k_layernorm" in name:
        return True
    return sequence_parallel and ("layernorm" in name or ".router." in name)


def _tp_sharded(name: str) -> bool:
    """Split over TP (vs replicated: norms, the router, the value head). By name, as
    :mod:`.hf_mapping` lays them out (the local spec leaves ``tensor_model_parallel`` unset
    when ``perform_initialization`` is off)."""
    return name.startswith("policy.gpt.") and "layernorm" not in name and ".router." not in name


class MegatronTrainer(TorchTrainer):
    """One rank of the Megatron backend (the process group and :func:`init_parallel` come first)."""

    def __init__(self, model: Any, config: TrainerConfig | dict[str, Any] | None = None, *,
                 device: str | torch.device | None = None) -> None:
        self.config = cfg = TrainerConfig.load(config)
        self._threads = None
        self._use_threads(cfg.num_threads)
        self.device = torch.device(device if device is not None else cfg.parallel.device)
        check_supported(cfg)
        self.layout = rank_layout()
        self.comm = MegatronComm(self.device)
        hf = build_causal_lm(model, torch.device("cpu"), cfg.seed)
        self.hf_config = hf.config
        self.shape = shape_of(hf.config)
        cfg.megatron.check(dist.get_world_size(), self.shape)
        self.sequence_parallel = cfg.megatron.sequence_parallel and self.layout.tp > 1
        pad = getattr(hf.config, "pad_token_id", None)
        self.vocab_size = self.shape.vocab
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
        self.policy = self._build(hf_state, hf.config)
        if cfg.weight_format != "full":  # quantisation-aware training: the engines' values in the forward
            from miles_engine.precision.quantizer import QuantizeError
            from miles_engine.precision.targets import quantized_weights
            from miles_engine.trainer.megatron import qat

            try:
                targets = quantized_weights(hf, cfg.weight_format, cfg.weight_exceptions)
                qat.apply(self.policy.gpt, self.shape, self.layout, cfg.weight_format, targets)
            except QuantizeError as exc:
                raise ConfigError(f"trainer.weight_format={cfg.weight_format}: {exc}") from None
        del hf
        self.root = nn.ModuleDict({"policy": self.policy})
        self.reference: nn.Module | None = None
        if cfg.kl.reference:
            if cfg.kl.reference_source is not None:
                ref_hf = build_causal_lm(cfg.kl.reference_source, torch.device("cpu"), cfg.seed)
                hf_state, ref_config = {k: v.detach() for k, v in ref_hf.state_dict().items()}, ref_hf.config
                del ref_hf
            else:
                ref_config = self.hf_config
            self.reference = self.root["reference"] = self._build(hf_state, ref_config, frozen=True)
        del hf_state
        self.value_head: nn.Module | None = None
        self.critic = None
        if cfg.algorithm.advantage_estimator == "ppo":
            self.value_head = self.root["value_head"] = ValueHead(self.shape.hidden).to(self.device)
        self.replay = None
        if cfg.algorithm.routing_replay:
            from miles_engine.trainer.megatron.replay import MegatronRoutingReplay

            offset = self.layout.layers(self.shape.layers).start
            split = (self.layout.tp, self.layout.tp_rank) if self.sequence_parallel else (1, 0)
            self.replay = MegatronRoutingReplay(self.policy, num_layers=self.shape.layers, layer_offset=offset,
                                                sequence_split=split)
        self.prefix_mode = self.ref_prefix_mode = None  # the shared-prefix forward needs a HF KV cache
        groups = [{"params": list(self.policy.parameters())}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": cfg.value.lr or cfg.optimizer.lr})
        self.optimizer, self.scheduler = build_optimizer(groups, cfg.optimizer, cfg.lr_schedule)
        self._sft_opt = None
        self.streams = {}  # trainer.optimizer_state=disk: each rank streams its shards' state
        stream_state(self, self.optimizer, "rl")
        self.weight_version = 0
        self.rl_steps = 0
        self.sft_steps = 0
        self.capture_grads = False
        self.captured_grads: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ weights in
    def _build(self, hf_state: dict[str, Tensor], hf_config: Any, *, frozen: bool = False) -> HFCausalLM:
        shape = shape_of(hf_config)
        m = self.config.megatron
        gpt = build_gpt(hf_config, tp=m.tensor_parallel, pp=m.pipeline_parallel, ep=m.expert_parallel,
                        sp=m.sequence_parallel)
        self._load_params(gpt, hf_state, shape)
        lm = HFCausalLM(gpt, hf_config).to(self.device).eval()  # eval: no dropout, as the torch backend
        lm.requires_grad_(not frozen)
        return lm

    def _load_params(self, gpt: nn.Module, hf_state: dict[str, Tensor], shape: Any) -> None:
        local = hm.to_megatron(hf_state, shape, self.layout)
        params = dict(gpt.named_parameters())
        if params.keys() != local.keys():
            raise RuntimeError(f"HF -> Megatron mapping does not match the GPTModel: missing "
                               f"{sorted(params.keys() - local.keys())[:4]}, unexpected {sorted(local.keys() - params.keys())[:4]}")
        with torch.no_grad():
            for name, p in params.items():
                if p.shape != local[name].shape:
                    raise RuntimeError(f"{name}: Megatron {tuple(p.shape)} vs mapped {tuple(local[name].shape)}")
                p.copy_(local[name])

    # ------------------------------------------------------------------ weights out
    def _gathered(self, local: dict[str, Tensor], shape: Any) -> dict[str, Tensor]:
        """Full HF tensors on global rank 0 ({} elsewhere) from every rank's Megatron-shaped ``local``
        (a collective over all ranks)."""
        from megatron.core import parallel_state as ps

        pieces = hm.to_hf_pieces(local, shape, self.layout)
        dense_lead = ps.get_data_parallel_rank() == 0
        expert_lead = ps.get_expert_data_parallel_rank() == 0
        pieces = [p for p in pieces if (expert_lead if ".mlp.experts." in p.name else dense_lead)]
        pieces = [hm.Piece(p.name, p.tensor.cpu(), p.dim, p.index) for p in pieces]
        if dist.get_world_size() == 1:
            return hm.merge_pieces(pieces, shape)
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(pieces, out, dst=0)
        if out is None:
            return {}
        return hm.merge_pieces([p for rank_pieces in out for p in rank_pieces], shape)

    def hf_state(self, module: HFCausalLM | None = None) -> dict[str, Tensor]:
        module = module or self.policy
        return self._gathered({k: v.detach() for k, v in module.gpt.named_parameters()}, shape_of(module.config))

    def hf_grads(self) -> dict[str, Tensor]:
        """The policy's gradients under HF names (rank 0; zeros where none): for parity checks."""
        return self._gathered({k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                               for k, p in self.policy.gpt.named_parameters()}, self.shape)

    def named_tensors(self, dtype: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """Full policy tensors under the HF names, gathered over TP / PP / EP on rank 0 (other ranks
        yield nothing); tied embeddings under both names, as the HF state dict has them."""
        target = _DTYPES[dtype] if dtype else None
        state = self.hf_state()
        return iter([(k, v.to(target) if target is not None else v) for k, v in state.items()])

    # ------------------------------------------------------------------ micro-batches and metrics
    def run_micro_batches(self, batch: Any, plan: list[list[int]], fn: Any, dummy: Any, *, grad: bool = True,
                          keys: Any = ()) -> dict[str, Tensor]:
        return pipeline.run_micro_batches(self, batch, plan, fn, dummy, grad=grad, keys=keys)

    def train_minibatches(self, minibatches: Any) -> dict[str, float]:
        return last_stage_metrics(super().train_minibatches(minibatches))

    def sft_step(self, batch: Any) -> dict[str, float]:
        return last_stage_metrics(super().sft_step(batch))

    # ------------------------------------------------------------------ gradients and the step
    def _reduce_grads(self, params: list[nn.Parameter]) -> None:
        from megatron.core import parallel_state as ps

        names = self._param_names()
        tp_group = ps.get_tensor_model_parallel_group()
        if dist.get_world_size(tp_group) > 1:  # replicated weights that saw part of the work: partial
            for p in params:                    # grads, summed (as megatron-core's finalize_model_grads)
                name = names.get(p, "")
                if p.grad is not None and _tp_partial(name, self.sequence_parallel):
                    dist.all_reduce(p.grad, group=tp_group)
        # The MoE dispatcher gathers tokens over TP x EP, so an expert's gradient already sums the
        # losses of its EP peers (other data-parallel ranks) and of its TP peers (the same tokens: no
        # sequence parallelism): TP x EP times the true share before the expert-data-parallel mean.
        tp_copies = 1 if self.sequence_parallel else dist.get_world_size(tp_group)  # SP: distinct tokens
        copies = tp_copies * ps.get_expert_model_parallel_world_size()
        if copies > 1:
            for p in params:
                if p.grad is not None and _is_expert(names.get(p, "")):
                    p.grad.div_(copies)
        for expert, group in ((False, ps.get_data_parallel_group()), (True, ps.get_expert_data_parallel_group())):
            size = dist.get_world_size(group)
            if size == 1:
                continue
            for p in params:
                if _is_expert(names.get(p, "")) != expert:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)

    def _param_names(self) -> dict[nn.Parameter, str]:
        return {p: f"policy.gpt.{n}" for n, p in self.policy.gpt.named_parameters()}

    def _grad_norm(self, params: list[nn.Parameter]) -> float:
        from megatron.core import parallel_state as ps

        names = self._param_names()
        tp_lead = ps.get_tensor_model_parallel_rank() == 0
        sq = torch.zeros(2, dtype=torch.float64, device=self.device)  # dense, expert
        for p in params:
            if p.grad is None:
                continue
            expert = _is_expert(names.get(p, ""))
            if self.shape.tied and names.get(p) == "policy.gpt.output_layer.weight":
                continue  # the PP copy of the tied embedding: counted on the first stage
            if _tp_sharded(names.get(p, "")) or expert or tp_lead:
                sq[int(expert)] += p.grad.detach().double().pow(2).sum()
        dense, expert = sq[:1].clone(), sq[1:].clone()
        if dist.get_world_size(ps.get_model_parallel_group()) > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
        if dist.get_world_size(ps.get_expert_tensor_model_pipeline_parallel_group()) > 1:
            dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + expert).sqrt().item())

    def optimizer_step(self, opt: torch.optim.Optimizer, sched: Any, params: list[nn.Parameter]) -> dict[str, float]:
        """As the torch backend's (``clip_grad_norm_`` semantics), over the sharded parameters."""
        reduce_tied_embedding_grads(self)
        self._reduce_grads(params)
        norm = self._grad_norm(params)
        if self.capture_grads:  # parity checks: the step's full gradient under HF names, before clipping
            self.captured_grads = self.hf_grads()
        lr = float(sched.get_last_lr()[0])
        skipped = not math.isfinite(norm)
        if not skipped:
            max_norm = self.config.grad_clip
            if max_norm is not None:
                coef = min(max_norm / (norm + 1e-6), 1.0)
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            stream = self.streams.get(id(opt))
            (stream.step if stream is not None else opt.step)()
            sched.step()
            self.weight_version += 1
        opt.zero_grad(set_to_none=True)
        out = {"grad_norm": norm, "lr": lr, "skipped_steps": float(skipped)}
        return {**out, **stream.figures()} if not skipped and stream is not None else out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The torch backend's format (HF parameter names), gathered on rank 0: see :mod:`.state`."""
        with all_resident(self.streams.values()):
            return state.state_dict(self)

    def load_state_dict(self, state_: dict[str, Any]) -> None:
        """Every rank gets the full state and loads its shards (from the state itself, or from the
        Megatron distributed checkpoint it names: :mod:`.dist_checkpoint`)."""
        with all_resident(self.streams.values()):
            if dist_checkpoint.is_dist(state_):
                dist_checkpoint.load(self, state_)
            else:
                state.load_state_dict(self, state_)

    def save_shards(self, directory: str) -> dict[str, Any]:
        """``trainer.megatron.checkpoint_format=dist``: this rank's shards into ``directory`` (a
        collective), the small rest returned (see :mod:`.dist_checkpoint`)."""
        with all_resident(self.streams.values()):
            return dist_checkpoint.save(self, directory)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        for stream in self.streams.values():
            stream.close()
        self.comm.close()


__all__ = ["MegatronTrainer", "init_parallel", "rank_layout"]
