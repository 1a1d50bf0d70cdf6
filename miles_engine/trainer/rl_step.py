"""The RL step of :class:`~miles_engine.trainer.torch_trainer.TorchTrainer`, in two phases.

``prepare``: no-grad forward passes for the old log-probs (the trainer's own, before the
update), reference log-probs and old values; then advantages (estimator, OPD term,
optional whitening) and the per-token mismatch weights with their metrics.
``update``: ``ppo_epochs`` passes over the minibatches; one optimizer step per minibatch.

Fused old log-probs (:attr:`TrainerConfig.fuses_old_logprobs`: one optimizer step per batch and
nothing in ``prepare`` reads them): the update's own forward runs on the weights the old pass
would have used, so its detached log-probs *are* the old log-probs. ``prepare`` then skips the
policy pass, and the loss uses ``old = logp.detach()`` (ratio exactly 1, the same gradient) and
computes the mismatch weights and statistics per micro-batch, reduced after the last one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from miles_engine.trainer import advantages as adv_fn
from miles_engine.trainer import corrections
from miles_engine.trainer.batch import MicroBatch, StepBatch
from miles_engine.trainer.losses import aggregate, kl_penalty, policy_loss, value_loss
from miles_engine.trainer.models import forward_logprobs, shift_values
from miles_engine.trainer.opd_loss import candidate_reverse_kl, sampled_reverse_kl

if TYPE_CHECKING:
    from miles_engine.trainer.torch_trainer import TorchTrainer


def _values(tr: TorchTrainer, ids: Tensor, attn: Tensor, hidden: Tensor | None) -> Tensor:
    if tr.value_head is not None:
        return shift_values(tr.value_head(hidden))
    return shift_values(tr.critic(ids, attn))


def prepare(tr: TorchTrainer, batch: StepBatch) -> dict[str, float]:
    cfg = tr.config
    alg = cfg.algorithm
    is_ppo = alg.advantage_estimator == "ppo"
    recompute = alg.old_logprobs == "recompute"
    fused = cfg.fuses_old_logprobs
    everything = list(range(batch.rows))
    use_value_head = is_ppo and tr.value_head is not None
    need_policy = (recompute and not fused) or use_value_head

    def old_pass(mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        ids, attn = mb.get("token_ids", tr.device), mb.get("attention_mask", tr.device)
        with tr.autocast():  # module order = TorchTrainer.dummy's (FSDP collectives must match)
            out = None
            if need_policy:
                tr.set_routing(mb)
                out = forward_logprobs(tr.policy, ids, attn, temperature=alg.temperature, hidden=use_value_head,
                                       mask=mb.get("loss_mask", tr.device), prefix=tr.prefix_mode)
                if recompute and not fused:
                    mb.put("old_logp", out.logp)
            if is_ppo:
                mb.put("old_values", _values(tr, ids, attn, out.hidden if out is not None else None))
            if tr.reference is not None:
                mb.put("ref_logp", forward_logprobs(tr.reference, ids, attn, temperature=alg.temperature,
                                                    mask=mb.get("loss_mask", tr.device),
                                                    prefix=tr.ref_prefix_mode).logp)
        return torch.zeros(()), {}

    def dummy() -> Tensor:
        return tr.dummy(policy=need_policy, value=is_ppo, reference=tr.reference is not None)

    for name, wanted in (("old_logp", recompute and not fused), ("old_values", is_ppo),
                         ("ref_logp", tr.reference is not None)):
        if wanted:  # a rank may have no rows at all
            batch.extra[name] = torch.zeros(batch.token_ids.shape, dtype=torch.float32)
    if need_policy or is_ppo or tr.reference is not None:
        with torch.no_grad():
            shared = not is_ppo and (tr.reference is None or tr.ref_prefix_mode is not None)
            tr.run_micro_batches(batch, tr.plan(batch, everything, shared=shared), old_pass, dummy, grad=False)
    mask = batch.loss_mask
    if not recompute:
        batch.extra["old_logp"] = batch.rollout_logp.clone()
    old = None if fused else batch.extra["old_logp"] * mask  # fused: nothing below reads it
    metrics: dict[str, float] = {}
    kl_reward = None
    if cfg.kl.placement == "reward" and tr.reference is not None:
        kl_reward = kl_penalty(old, batch.extra["ref_logp"], cfg.kl.estimator) * mask

    est = alg.advantage_estimator
    if est in ("grpo", "gspo"):
        per_row = adv_fn.grpo_advantages(batch.rewards, batch.group_index,
                                         std_normalization=alg.grpo_std_normalization, eps=alg.std_eps)
        advantages = adv_fn.broadcast_to_tokens(per_row, mask)
    elif est == "reinforce_pp":
        rewards = adv_fn.group_mean_baseline(batch.rewards, batch.group_index) if alg.reinforce_pp_baseline \
            else batch.rewards
        advantages = adv_fn.reinforce_pp_advantages(rewards, mask, gamma=alg.gamma, kl=kl_reward,
                                                    kl_coef=cfg.kl.coef, moments_fn=tr.comm.all_sum)
    else:
        rewards = adv_fn.token_rewards(batch.rewards, mask, kl_reward, cfg.kl.coef)
        advantages, returns = adv_fn.gae(rewards, batch.extra["old_values"], mask, alg.gamma, cfg.value.gae_lambda)
        batch.extra["returns"] = returns
    if not cfg.opd.task_reward:
        advantages = torch.zeros_like(advantages)
    if cfg.opd.beta:
        advantages = adv_fn.opd_adjust(advantages, old, batch.teacher_logp, mask, cfg.opd.beta)
    if alg.normalize_advantages and est != "reinforce_pp":
        advantages = adv_fn.whiten(advantages, mask, tr.comm.all_sum(adv_fn.masked_moments(advantages, mask)))
    batch.extra["advantages"] = advantages
    # what each row trained with, as the run's trajectory record shows it (GRPO: the row's value)
    batch.extra["row_advantage"] = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    truncated = batch.truncated if batch.truncated is not None else torch.zeros(batch.rows)
    if cfg.mask_truncated:  # overlong filtering: no loss on them; their rewards stayed in the group baseline
        batch.loss_mask = mask = mask * (1.0 - truncated)[:, None]

    sums = {"reward_sum": batch.rewards.double().sum(), "rows": torch.tensor(float(batch.rows), dtype=torch.float64),
            "adv_sum": (advantages * mask).double().sum(), "adv_abs_sum": (advantages.abs() * mask).double().sum(),
            "tokens": mask.double().sum(), "truncated": truncated.double().sum()}
    if kl_reward is not None:
        sums["kl_reward_sum"] = kl_reward.double().sum()
    if "routed" in batch.extra:  # positions replayed (one before each sampled token with a recorded route)
        sums["replayed"] = (batch.extra["routed"][:, :, 0, 0] >= 0).double().sum()
    if recompute and not fused:  # fused: the update computes them (MismatchAccumulator)
        m = cfg.mismatch
        if m.mode != "none":
            batch.extra["mismatch_w"] = corrections.mismatch_weights(old, batch.rollout_logp, mask, m.mode, m.low,
                                                                     m.high)
        metrics.update(corrections.reduce_stats(tr.comm, *corrections.mismatch_stats(old, batch.rollout_logp, mask,
                                                                                      m.low, m.high)))
        if "versions" in batch.extra:
            metrics.update(corrections.reduce_split(tr.comm, *corrections.version_split_stats(
                old, batch.rollout_logp, mask, batch.extra["versions"], tr.weight_version)))
    red = tr.reduce_metrics(sums)
    n_tok, n_rows = max(red["tokens"], 1.0), max(red["rows"], 1.0)
    metrics.update(reward_mean=red["reward_sum"] / n_rows, advantage_mean=red["adv_sum"] / n_tok,
                   advantage_abs_mean=red["adv_abs_sum"] / n_tok, tokens=red["tokens"], sequences=red["rows"],
                   truncated_fraction=red["truncated"] / n_rows)
    if "kl_reward_sum" in red:
        metrics["kl_reward"] = red["kl_reward_sum"] / n_tok
    if "replayed" in red:
        metrics["r3/replayed_fraction"] = red["replayed"] / n_tok
    return metrics


def _loss_fn(tr: TorchTrainer, n_tok: float, n_seq: float, fused: corrections.MismatchAccumulator | None = None):
    """The update's loss per micro-batch and its metric keys; ``fused``: old log-probs and
    mismatch weights come from this forward (recorded in the accumulator)."""
    cfg = tr.config
    alg, clip = cfg.algorithm, cfg.clip
    is_ppo = alg.advantage_estimator == "ppo"
    want_hidden = is_ppo and tr.value_head is not None
    mode = cfg.loss_aggregation

    def agg(x: Tensor, mask: Tensor) -> Tensor:
        return aggregate(x, mask, mode, num_tokens=n_tok, num_seqs=n_seq)

    keys = ["loss", "pg_loss", "entropy", "clipfrac", "dual_clipfrac", "ratio_mean"]
    keys += ["kl"] if tr.reference is not None else []
    keys += ["value_loss", "value_clipfrac"] if is_ppo else []
    opd = cfg.opd
    keys += ["opd/sampled_log_ratio"] if opd.enabled else []
    keys += ["opd/loss", "opd/reverse_kl"] if opd.coef else []
    keys += ["opd/candidates"] if opd.uses_candidates else []

    def fn(mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        ids, attn = mb.get("token_ids", tr.device), mb.get("attention_mask", tr.device)
        mask, advantages = mb.get("loss_mask", tr.device), mb.get("advantages", tr.device)
        tr.set_routing(mb)
        with tr.autocast():
            cands = mb.get("opd_cand_ids", tr.device) if opd.uses_candidates else None
            out = forward_logprobs(tr.policy, ids, attn, temperature=alg.temperature, mask=mask,
                                   entropy="grad" if cfg.entropy_coef else "metric", hidden=want_hidden,
                                   candidates=cands, prefix=tr.prefix_mode)
            if fused is not None:
                old = out.logp.detach()
                if "trainer_logp" in mb.batch.extra:  # rows the run's trajectory record keeps
                    mb.put("trainer_logp", old)
                versions = mb.get("versions", tr.device) if "versions" in mb.batch.extra else None
                weights = fused.add(old, mb.get("rollout_logp", tr.device), mask, versions)
            else:
                old = mb.get("old_logp", tr.device)
                weights = mb.get("mismatch_w", tr.device) if "mismatch_w" in mb.batch.extra else None
            pl = policy_loss(out.logp, old, advantages, mask, eps_low=clip.eps_low, eps_high=clip.high,
                             dual_clip_c=clip.dual_clip_c, sequence_level=alg.advantage_estimator == "gspo")
            pg = pl.loss * weights if weights is not None else pl.loss
            pg_loss = agg(pg, mask)
            entropy = agg(out.entropy, mask)
            loss = pg_loss - cfg.entropy_coef * entropy
            per_token = 1.0 / max(n_tok, 1.0)
            m = {"pg_loss": pg_loss, "entropy": entropy, "clipfrac": pl.clipped.sum() * per_token,
                 "dual_clipfrac": pl.dual_clipped.sum() * per_token, "ratio_mean": (pl.ratio * mask).sum() * per_token}
            if opd.enabled:
                teacher = mb.get("teacher_logp", tr.device)
                m["opd/sampled_log_ratio"] = ((out.logp.detach() - teacher) * mask).sum() * per_token
            if opd.coef:
                if opd.uses_candidates:
                    cmask = mb.get("opd_cand_mask", tr.device) * mask[..., None]
                    opd_loss, opd_value = candidate_reverse_kl(out.cand_logp, mb.get("opd_cand_teacher", tr.device),
                                                               cmask, opd.weighting)
                    m["opd/candidates"] = cmask.sum() * per_token
                else:
                    opd_loss, opd_value = sampled_reverse_kl(out.logp, teacher, mask)
                m["opd/loss"] = agg(opd_loss, mask)
                m["opd/reverse_kl"] = (opd_value.detach() * mask).sum() * per_token
                loss = loss + opd.coef * m["opd/loss"]
            if tr.reference is not None:
                kl = agg(kl_penalty(out.logp, mb.get("ref_logp", tr.device), cfg.kl.estimator), mask)
                m["kl"] = kl
                if cfg.kl.placement == "loss" and cfg.kl.coef:
                    loss = loss + cfg.kl.coef * kl
            if is_ppo:
                values = _values(tr, ids, attn, out.hidden)
                vl, vclip = value_loss(values, mb.get("old_values", tr.device), mb.get("returns", tr.device), mask,
                                       cfg.value.clip)
                m["value_loss"] = agg(vl, mask)
                m["value_clipfrac"] = vclip.sum() * per_token
                loss = loss + cfg.value.coef * m["value_loss"]
        m["loss"] = loss
        return loss, m

    return fn, keys


def update(tr: TorchTrainer, batch: StepBatch, n_minibatches: int) -> dict[str, float]:
    cfg = tr.config
    is_ppo = cfg.algorithm.advantage_estimator == "ppo"
    totals: dict[str, float] = {}
    steps = 0
    for _epoch in range(cfg.ppo_epochs):
        for m in range(n_minibatches):
            rows = [i for i in range(batch.rows) if batch.minibatch[i] == m]
            n_tok, n_seq = tr.global_counts(batch, rows)
            if n_tok == 0:
                continue  # every rank agrees: the counts are global
            m_cfg = cfg.mismatch
            fused = corrections.MismatchAccumulator(m_cfg.mode, m_cfg.low, m_cfg.high, tr.weight_version) \
                if cfg.fuses_old_logprobs else None
            fn, keys = _loss_fn(tr, n_tok, n_seq, fused)
            sums = tr.run_micro_batches(batch, tr.plan(batch, rows, shared=not is_ppo), fn,
                                        lambda: tr.dummy(value=is_ppo), keys=keys)
            got = tr.reduce_metrics(sums)
            if fused is not None:
                got.update(fused.finalize(tr.comm))
            got.update(tr.optimizer_step(tr.optimizer, tr.scheduler, tr.trainable()))
            for k, v in got.items():
                totals[k] = totals.get(k, 0.0) + v
            steps += 1
    out = {k: v / max(steps, 1) for k, v in totals.items()}
    out["skipped_steps"] = totals.get("skipped_steps", 0.0)
    out["optimizer_steps"] = float(steps)
    return out


def optimizer_step(tr: TorchTrainer, opt: torch.optim.Optimizer, sched: Any, params: list[Any]) -> dict[str, float]:
    """Clip, step (streaming the optimizer state where ``trainer.optimizer_state=disk``), schedule."""
    max_norm = tr.config.grad_clip if tr.config.grad_clip is not None else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lr = float(sched.get_last_lr()[0])
    skipped = not math.isfinite(norm)
    stream = tr.streams.get(id(opt))
    if not skipped:
        (stream.step if stream is not None else opt.step)()
        sched.step()
        tr.weight_version += 1
    opt.zero_grad(set_to_none=True)
    out = {"grad_norm": norm, "lr": lr, "skipped_steps": float(skipped)}
    return out if stream is None else {**out, **stream.figures()}
