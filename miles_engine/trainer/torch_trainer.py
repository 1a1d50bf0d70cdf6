"""``TorchTrainer``: the torch trainer backend in one process (or one FSDP2 rank).

    trainer = TorchTrainer("tiny:qwen3", {"optimizer": {"lr": 1e-3}})
    metrics = trainer.sft_step([(token_ids, loss_mask), ...])
    metrics = trainer.train_step(groups)                  # whole groups, GRPO family / PPO
    engine_weights = dict(trainer.named_tensors())        # HF names, full tensors
    state = trainer.state_dict(); trainer.load_state_dict(state)

With ``comm=FSDP2(device)`` (see :mod:`miles_engine.trainer.distributed`) the same code runs
as one rank of a data-parallel FSDP2 group: losses are normalised by global token and
sequence counts, ranks with fewer micro-batches run zero-weight dummy ones so collectives
stay in step, and metrics are all-reduced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from miles_engine.errors import ConfigError
from miles_engine.precision import qat
from miles_engine.precision.diagnose import class_gaps
from miles_engine.precision.quantizer import QuantizeError
from miles_engine.rollout.types import Group
from miles_engine.trainer import lora, prefix, rl_step, step_rows, trainer_state
from miles_engine.trainer.offload import Offloader, for_trainer, resident, state_tensors
from miles_engine.trainer.batch import MicroBatch, StepBatch, from_groups, from_sft_rows
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.losses import aggregate
from miles_engine.trainer.models import (Critic, ValueHead, build_causal_lm, forward_logprobs, frozen_copy,
                                         hidden_size, keep_mask)
from miles_engine.trainer.optim import build_optimizer
from miles_engine.trainer.optimizer_stream import StreamedOptimizerState, stream_state
from miles_engine.trainer.parallel import Local
from miles_engine.trainer.rows import as_sft_rows, plan_micro_batches, split_groups, validate_groups

LossFn = Callable[[MicroBatch], tuple[Tensor, dict[str, Tensor]]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchTrainer:
    """Policy (+ reference, + critic) and optimizers; implements :class:`TrainerBackend`."""

    offloader: Offloader | None = None  # trainer.offload (a subclass with its own __init__ has none)

    def __init__(self, model: Any, config: TrainerConfig | dict[str, Any] | None = None, *,
                 device: str | torch.device | None = None, comm: Local | None = None) -> None:
        self.config = cfg = TrainerConfig.load(config)
        self._threads: int | None = None
        self._use_threads(cfg.num_threads)
        self.device = torch.device(device if device is not None else cfg.parallel.device)
        if cfg.dtype == "bfloat16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("trainer.dtype=bfloat16 but this GPU does not support bfloat16; use float32")
        self.comm = comm or Local()
        self.policy = build_causal_lm(model, self.device, cfg.seed)
        if cfg.lora.enabled:  # adapters only train; engines get the merged weights of adapted modules
            lora.apply(self.policy, cfg.lora)
        if cfg.weight_format != "full":
            try:
                qat.apply(self.policy, cfg.weight_format, cfg.weight_exceptions)
            except QuantizeError as exc:
                raise ConfigError(f"trainer.weight_format={cfg.weight_format}: {exc}") from None
        if cfg.true_on_policy:
            from miles_engine import batch_invariant

            try:
                batch_invariant.enable(self.policy)
            except ValueError as exc:
                raise ConfigError(f"trainer.true_on_policy: {exc}") from None
        if cfg.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.vocab_size = int(self.policy.get_input_embeddings().num_embeddings)
        pad = getattr(self.policy.config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.root = nn.ModuleDict({"policy": self.policy})
        self.reference: nn.Module | None = None
        if cfg.kl.reference:
            src = cfg.kl.reference_source
            self.reference = frozen_copy(self.policy if src is None else build_causal_lm(src, self.device, cfg.seed))
            self.root["reference"] = self.reference
        self.value_head: nn.Module | None = None
        self.critic: nn.Module | None = None
        if cfg.algorithm.advantage_estimator == "ppo":
            if cfg.value.kind == "head":
                self.value_head = self.root["value_head"] = ValueHead(hidden_size(self.policy)).to(self.device)
            else:
                lm = build_causal_lm(cfg.value.critic_source or self.policy.config, self.device, cfg.seed + 1)
                self.critic = self.root["critic"] = Critic(lm).to(self.device)
        self.replay = None
        if cfg.algorithm.routing_replay:
            from miles_engine.trainer.replay import RoutingReplay

            self.replay = RoutingReplay(self.policy)
        for module in self.root.values():
            self.comm.shard(module)
        self.prefix_mode = self._prefix_mode()
        self.ref_prefix_mode = self.prefix_mode if self.reference is not None and prefix.supports(self.reference) \
            else None
        value_params = [p for k in ("value_head", "critic") if k in self.root for p in self.root[k].parameters()]
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad]}]
        if value_params:
            groups.append({"params": value_params, "lr": cfg.value.lr or cfg.optimizer.lr})
        self.optimizer, self.scheduler = build_optimizer(groups, cfg.optimizer, cfg.lr_schedule)
        self._sft_opt: tuple[torch.optim.Optimizer, Any] | None = None
        self.offloader = for_trainer(cfg.offload, cfg.offload_dir, self.device, name=f"trainer-rank{self.comm.rank}")
        self.streams: dict[int, StreamedOptimizerState] = {}  # trainer.optimizer_state=disk, per optimizer
        stream_state(self, self.optimizer, "rl")
        self.weight_version = 0
        self.rl_steps = 0
        self.sft_steps = 0

    # ------------------------------------------------------------------ helpers
    def _prefix_mode(self) -> prefix.PrefixMode | None:
        """How policy forwards share prompts (``trainer.shared_prefix``). FSDP ranks use the
        two-pass forward on every micro-batch (dummies too), so their collectives stay in step."""
        cfg = self.config
        if not cfg.shared_prefix or cfg.gradient_checkpointing or self.replay is not None:
            return None
        if not prefix.supports(self.policy):
            return None
        return "always" if self.comm.world_size > 1 else "auto"

    @property
    def routing(self) -> tuple[int, int, int] | None:
        """(MoE layers, top_k, experts) when routing replay is on."""
        return None if self.replay is None else (self.replay.num_layers, self.replay.top_k, self.replay.num_experts)

    def set_routing(self, mb: MicroBatch | None) -> None:
        """Replay the rollout's experts in the next policy forward (``None``: the policy's own)."""
        if self.replay is not None:
            self.replay.set(mb.get("routed", self.device) if mb is not None and "routed" in mb.batch.extra else None)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.config.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.config.dtype])

    def trainable(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def sft_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        sft = self.config.sft
        if sft.optimizer is None and sft.lr_schedule is None:
            return self.optimizer, self.scheduler
        if self._sft_opt is None:
            self._sft_opt = build_optimizer([{"params": [p for p in self.policy.parameters() if p.requires_grad]}],
                                            sft.optimizer or self.config.optimizer,
                                            sft.lr_schedule or self.config.lr_schedule)
            stream_state(self, self._sft_opt[0], "sft")
        return self._sft_opt

    def global_counts(self, batch: StepBatch, rows: Sequence[int]) -> tuple[float, float]:
        """Sampled tokens and sequences (rows with >= 1 sampled token) over every rank."""
        per_row = batch.loss_mask[list(rows)].sum(dim=1) if rows else torch.zeros(0)
        local = torch.tensor([per_row.sum().item(), (per_row > 0).sum().item()], dtype=torch.float64)
        n, s = self.comm.all_sum(local).tolist()
        return n, s

    def plan(self, batch: StepBatch, rows: Sequence[int], *, shared: bool = False) -> list[list[int]]:
        """Micro-batches of ``rows`` within ``max_tokens_per_micro_batch`` padded tokens; ``shared``:
        every forward on them shares prompts (:attr:`prefix_mode`), so cost and group them that way."""
        rows = list(rows)
        lengths = [batch.lengths[i] for i in rows]
        budget = self.config.max_tokens_per_micro_batch
        if shared and self.prefix_mode is not None and rows:
            idx = torch.tensor(rows, dtype=torch.long)
            keys = prefix.row_prefixes(batch.token_ids[idx], keep_mask(batch.loss_mask[idx]), lengths)
            local = prefix.plan_micro_batches(keys, lengths, budget, self.prefix_mode)
        else:
            local = plan_micro_batches(lengths, budget)
        return [[rows[i] for i in mb] for mb in local]

    def n_micro(self, plan: list[list[int]]) -> int:
        return int(self.comm.all_max(torch.tensor([len(plan)], dtype=torch.float64)).item())

    def dummy(self, *, policy: bool = True, value: bool = False, reference: bool = False) -> Tensor:
        """A zero-weight forward through the given modules on a 2-token row: a rank with fewer
        micro-batches runs these so every FSDP collective has all ranks (backward too)."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        attn = torch.ones_like(ids)
        loss = torch.zeros((), device=self.device)
        self.set_routing(None)
        with self.autocast():
            value_head = value and self.value_head is not None
            if policy and self.prefix_mode == "always" and not value_head:  # as forward_logprobs(prefix=...)
                loss = loss + prefix.dummy_logits(self.policy, self.device).float().sum() * 0.0
            elif policy or value_head:
                out = self.policy(input_ids=ids, attention_mask=attn, output_hidden_states=value, use_cache=False)
                loss = loss + out.logits.float().sum() * 0.0
                if value_head:
                    loss = loss + self.value_head(out.hidden_states[-1]).sum() * 0.0
            if value and self.critic is not None:
                loss = loss + self.critic(ids, attn).sum() * 0.0
            if reference and self.reference is not None:
                if self.ref_prefix_mode == "always":
                    prefix.dummy_logits(self.reference, self.device)
                else:
                    self.reference(input_ids=ids, attention_mask=attn, use_cache=False)
        return loss

    def run_micro_batches(self, batch: StepBatch, plan: list[list[int]], fn: LossFn,
                          dummy: Callable[[], Tensor], *, grad: bool = True,
                          keys: Sequence[str] = ()) -> dict[str, Tensor]:
        """``fn`` on each micro-batch (then backward when ``grad``; the loss is scaled by the world
        size because FSDP averages gradients over ranks); returns the local sums of its metrics,
        which must be exactly ``keys`` (every rank reduces the same vector, even a rank that ran
        only dummies)."""
        sums = {k: torch.zeros((), dtype=torch.float64) for k in keys}
        for i in range(self.n_micro(plan)):
            loss, metrics = fn(batch.slice(plan[i])) if i < len(plan) else (dummy(), {})
            if grad:
                (loss * self.comm.world_size).backward()
            if metrics.keys() - sums.keys():
                raise RuntimeError(f"metrics {sorted(metrics.keys() - sums.keys())} are not declared in keys")
            for k, v in metrics.items():
                sums[k] = sums[k] + v.detach().double().cpu()
        self.set_routing(None)
        return sums

    def optimizer_step(self, opt: torch.optim.Optimizer, sched: Any, params: list[nn.Parameter]) -> dict[str, float]:
        return rl_step.optimizer_step(self, opt, sched, params)

    def reduce_metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Sum over ranks; every rank must pass the same keys (a collective)."""
        if not sums:
            return {}
        keys = sorted(sums)
        vec = self.comm.all_sum(torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys]))
        return dict(zip(keys, vec.tolist()))

    # ------------------------------------------------------------------ public API
    def _use_threads(self, threads: int | None) -> None:
        """SFT may run with more intra-op threads than RL steps, which share the box with rollouts."""
        if threads and threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    records_rows = True  # train_step(groups, record=...) reports per-trajectory rows (step_rows)

    def train_step(self, groups: Sequence[Group], record: Collection[tuple[str, int]] | None = None) -> dict[str, Any]:
        """One RL step on whole groups: ``ppo_epochs x minibatches`` optimizer steps. ``record``: the
        (group_id, index) whose trainer log-probs the run's trajectory record wants; when given, the
        result also holds per-trajectory rows under ``step_rows.ROWS_KEY``."""
        validate_groups(groups, vocab_size=self.vocab_size, need_teacher=self.config.opd.enabled,
                        std_normalization=self.config.uses_std_normalization, routing=self.routing,
                        need_candidates=self.config.opd.uses_candidates)
        parts = min(self.config.minibatches, len(groups))
        return self.train_minibatches(split_groups(groups, parts), record)

    def offload(self) -> dict[str, float]:
        """The trainer waits until its next call: its state leaves memory (``trainer.offload``)."""
        if self.offloader is None:
            return {}
        opts = [self.optimizer] + ([self._sft_opt[0]] if self._sft_opt else [])
        return self.offloader.offload(state_tensors(self.root.values(), opts)).figures()

    @resident
    def reload(self) -> None:
        """Bring an offloaded state back now (views of it, such as the last pushed tensors, read it)."""

    @resident
    def train_minibatches(self, minibatches: Sequence[Sequence[Group]],
                          record: Collection[tuple[str, int]] | None = None) -> dict[str, Any]:
        """``train_step`` on pre-split minibatches (a rank's share; lists may be empty)."""
        t0 = time.perf_counter()
        self._use_threads(self.config.num_threads)
        if self.rl_steps == 0 and self.sft_steps > 0:
            self._reference_from_policy()
        batch = from_groups(minibatches, teacher=self.config.opd.enabled, pad_id=self.pad_id,
                            routing=self.routing[:2] if self.routing else None,
                            candidates=self.config.opd.uses_candidates)
        keys = step_rows.row_keys(minibatches) if record is not None else []
        wanted = [k in record for k in keys] if record is not None else []
        if any(wanted) and self.config.fuses_old_logprobs:  # the update's forward fills the rows asked for
            batch.extra["trainer_logp"] = torch.zeros(batch.token_ids.shape, dtype=torch.float32)
        metrics: dict[str, Any] = rl_step.prepare(self, batch)
        t1 = time.perf_counter()
        metrics.update(rl_step.update(self, batch, len(minibatches)))
        if record is not None:
            own = self.config.algorithm.old_logprobs == "recompute"
            logp = batch.extra.get("trainer_logp" if self.config.fuses_old_logprobs else "old_logp") if own else None
            metrics[step_rows.ROWS_KEY] = step_rows.step_rows(keys, batch.lengths, batch.extra.get("row_advantage"),
                                                              logp, set(record))
        self.rl_steps += 1
        metrics.update(prepare_time=t1 - t0, update_time=time.perf_counter() - t1,
                       step_time=time.perf_counter() - t0, weight_version=float(self.weight_version))
        if self.offloader is not None:
            metrics["offload_reload_time"] = self.offloader.report.reload_s
        return metrics

    @torch.no_grad()
    def _reference_from_policy(self) -> None:
        """The KL anchor is the policy RL starts from: after this trainer's SFT warm start, not the
        weights before it (the reference was copied at construction). Same structure and sharding."""
        if self.reference is None or self.config.kl.reference_source is not None:
            return
        for ref, param in zip(self.reference.parameters(), self.policy.parameters(), strict=True):
            ref.copy_(param)

    @resident
    def sft_step(self, batch: Sequence[Any]) -> dict[str, float]:
        """Cross-entropy on the loss-mask tokens of ``(token_ids, loss_mask)`` rows; one optimizer step."""
        t0 = time.perf_counter()
        self._use_threads(self.config.sft.num_threads or self.config.num_threads)
        rows = as_sft_rows(batch, self.vocab_size) if len(batch) else []
        sb = from_sft_rows(rows, self.pad_id)
        everything = list(range(sb.rows))
        n_tok, n_seq = self.global_counts(sb, everything)
        mode, temp = self.config.sft.aggregation, self.config.algorithm.temperature

        def loss_fn(mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
            ids, attn, mask = (mb.get(k, self.device) for k in ("token_ids", "attention_mask", "loss_mask"))
            with self.autocast():
                out = forward_logprobs(self.policy, ids, attn, temperature=temp, mask=mask, prefix=self.prefix_mode)
            loss = aggregate(-out.logp, mask, mode, num_tokens=n_tok, num_seqs=n_seq)
            nll = (-out.logp * mask).sum() / max(n_tok, 1.0)
            return loss, {"loss": loss, "nll": nll}

        opt, sched = self.sft_optimizer()
        with lora.sft_dropout(self.policy, self.config.lora):
            sums = self.run_micro_batches(sb, self.plan(sb, everything, shared=True), loss_fn, self.dummy,
                                          keys=("loss", "nll"))
        metrics = self.reduce_metrics(sums)
        metrics.update(self.optimizer_step(opt, sched, [p for g in opt.param_groups for p in g["params"]]))
        self.sft_steps += 1
        metrics.update(tokens=n_tok, sequences=n_seq, step_time=time.perf_counter() - t0,
                       weight_version=float(self.weight_version))
        return metrics

    @resident
    @torch.no_grad()
    def compute_logprobs(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Per-token log-probs (index 0 = 0) of ``(token_ids, loss_mask)`` rows under the current
        policy, as the old-log-prob pass computes them (one process only)."""
        sb = from_sft_rows([as_sft_rows([r])[0] for r in rows], self.pad_id)
        out = torch.zeros(sb.token_ids.shape)
        self.set_routing(None)
        for mb_rows in self.plan(sb, range(sb.rows)):
            mb = sb.slice(mb_rows)
            with self.autocast():
                res = forward_logprobs(self.policy, mb.get("token_ids", self.device),
                                       mb.get("attention_mask", self.device),
                                       temperature=self.config.algorithm.temperature)
            out[mb.idx, : mb.width] = res.logp.float().cpu()
        return [out[i, :n].tolist() for i, n in enumerate(sb.lengths)]

    @resident
    def precision_gaps(self, groups: Sequence[Group], fmt: str, exceptions: Sequence[str],
                       rows: int = 4) -> dict[str, float]:
        """Per tensor class, how far quantising only it in ``fmt`` moves the policy's log-probs of
        the sampled tokens of ``rows`` trajectories of ``groups`` (:mod:`miles_engine.precision.diagnose`)."""
        picked = [(t.token_ids, t.loss_mask) for g in groups for t in g.trajectories if t.status == "ok"][:rows]
        return class_gaps(self.policy, picked, fmt, exceptions)

    @resident
    def named_tensors(self, dtype: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """Full policy tensors under the HF state-dict names (tied weights under each name). In one
        process they may share storage with the live weights (copy before the next step). FSDP:
        gathered on rank 0; other ranks yield nothing. ``trainer.lora.push=adapters``: the adapters'
        parts instead of merged weights (an :class:`~miles_engine.models.adapters.AdapterExport`)."""
        return trainer_state.named_tensors(self, _DTYPES[dtype] if dtype else None)

    @resident
    def full_tensors(self) -> dict[str, Tensor]:
        """The policy's full tensors on every rank (the p2p transport's sources): see :func:`trainer_state.full_tensors`."""
        return trainer_state.full_tensors(self)

    @resident
    def state_dict(self) -> dict[str, Any]:
        """Everything to resume: model (policy, reference, critic), optimizer(s), scheduler(s),
        counters; parameter-name keyed, so it loads into either backend. In one process the
        tensors share storage with the live ones (like ``nn.Module.state_dict``): save or copy
        before the next step."""
        return trainer_state.full_state(self)

    @resident
    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer_state.load_full_state(self, state)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        if self.offloader is not None:
            self.offloader.close()
        for stream in self.streams.values():
            stream.close()
        self.comm.close()

    def __enter__(self) -> TorchTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

