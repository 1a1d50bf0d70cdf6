"""The speculative draft, trained alongside the policy (``speculative.train: true``).

A draft proposes and the policy verifies, so what decides the speed-up is how often the draft
guesses what the *current* policy samples — and the policy moves every step. Each step the draft
takes its own optimizer step on the tokens the policy just sampled (next-token cross-entropy on
the loss-masked positions: the policy's samples, so the draft is fitted to the policy's
distribution, forward KL), and its tensors go to the engines with the policy's under
``draft.<name>`` (:data:`~miles_engine.engines.embedded.draft.DRAFT_PREFIX`). The draft never
touches what is trained or recorded: exact speculative sampling keeps every token and log-prob
the policy's whatever the draft proposes.

It lives in the driver process (a draft is small), runs off the event loop, and its time is its
own slice of the step-time split (``time/train_draft``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from miles_engine.engines.embedded.draft import DRAFT_PREFIX
from miles_engine.engines.embedded.options import SpeculativeOptions
from miles_engine.errors import ConfigError
from miles_engine.models.loading import fit_draft_vocab, load_model
from miles_engine.rollout.types import Group
from miles_engine.trainer.rows import plan_micro_batches

Row = tuple[list[int], list[int]]  # token ids, loss mask (1 where the policy sampled)


class DraftTrainer:
    def __init__(self, options: SpeculativeOptions, *, seed: int = 0, device: str = "cpu",
                 vocab_size: int | None = None) -> None:
        self.options = options
        source = fit_draft_vocab(options.draft_model, vocab_size) if vocab_size else options.draft_model
        self.model, self.source = load_model(source, dtype="float32", device=device, seed=seed)
        self.model.train()
        for param in self.model.parameters():  # a loader for inference may have frozen them
            param.requires_grad_(True)
        self.device = torch.device(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=options.train_lr, weight_decay=0.0)
        self.steps = 0

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The draft's tensors as a push carries them (``draft.<name>``), copies: a push may keep
        them while the next step trains."""
        return {DRAFT_PREFIX + n: t.detach().clone() for n, t in self.model.state_dict().items()}

    def with_policy(self, tensors: Any) -> list[tuple[str, torch.Tensor]]:
        """A push's name/tensor pairs: the policy's export (a mapping or pairs), then the draft's."""
        pairs = list({**dict(tensors), **self.named_tensors()}.items())
        return tensors.with_pairs(pairs) if hasattr(tensors, "with_pairs") else pairs  # an adapter export stays one

    @staticmethod
    def rows(groups: Sequence[Group]) -> list[Row]:
        """Every trajectory's token row that holds sampled tokens (failed ones too: whatever the
        policy sampled is what the draft should learn to propose)."""
        return [(list(t.token_ids), list(t.loss_mask)) for g in groups for t in g.trajectories
                if len(t.token_ids) > 1 and any(t.loss_mask[1:])]

    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One optimizer step per epoch over this step's rows; ``draft/*`` metrics. Blocking (run
        it in a thread)."""
        rows = self.rows(groups)
        if not rows:
            return {"draft/tokens": 0.0}
        with torch.enable_grad():
            return self._train(rows)

    def _train(self, rows: list[Row]) -> dict[str, float]:
        loss_sum = correct = tokens = 0.0
        for _ in range(self.options.train_epochs):
            total = sum(sum(mask[1:]) for _, mask in rows)
            self.optimizer.zero_grad(set_to_none=True)
            for batch in _batches(rows, self.options.train_batch_tokens):
                loss, hits, n = self._loss(batch)
                (loss / total).backward()
                loss_sum, correct, tokens = loss_sum + float(loss.detach()), correct + hits, tokens + n
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.steps += 1
        return {"draft/loss": loss_sum / tokens, "draft/top1_agreement": correct / tokens,
                "draft/tokens": tokens / self.options.train_epochs, "draft/grad_norm": float(norm),
                "draft/steps": float(self.steps)}

    def _loss(self, batch: list[Row]) -> tuple[torch.Tensor, float, float]:
        """Summed cross-entropy of the sampled tokens given their prefix, how many the draft's
        argmax got right, and how many there were."""
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (row, loss_mask) in enumerate(batch):  # right padding: positions stay 0..n-1
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = torch.tensor(loss_mask, dtype=torch.bool)
            attention[i, :len(row)] = 1
        ids, mask, attention = ids.to(self.device), mask.to(self.device), attention.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        targets, keep = ids[:, 1:], mask[:, 1:]
        picked, wanted = logits[keep], targets[keep]
        loss = torch.nn.functional.cross_entropy(picked, wanted, reduction="sum")
        hits = float((picked.argmax(-1) == wanted).sum())
        return loss, hits, float(wanted.numel())

    def state_dict(self) -> dict[str, Any]:
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "steps": self.steps, "source": self.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


def _batches(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """Micro-batches of at most ``max_tokens`` padded tokens (a longer row goes alone)."""
    return [[rows[i] for i in plan] for plan in plan_micro_batches([len(ids) for ids, _ in rows], max_tokens)]


def draft_to_train(cfg: Any, kinds: Sequence[Any], *, seed: int, vocab_size: int | None = None) -> DraftTrainer | None:
    """The draft a run co-trains, from its engine groups' ``options.speculative`` (None when no
    group sets ``train``). Every group receives the same pushes, so either all of them co-train
    the same draft or none does: one error names the group that differs."""
    specs = [getattr(getattr(kind, "options", None), "speculative", None) for kind in kinds]
    training = [i for i, spec in enumerate(specs) if getattr(spec, "train", False)]
    if not training:
        return None
    first = specs[training[0]]
    for i, spec in enumerate(specs):
        if spec != first:
            why = ("has no speculative options (its kind cannot take a co-trained draft)" if spec is None else
                   "does not set speculative.train" if not getattr(spec, "train", False) else
                   "sets other speculative options")
            raise ConfigError(f"engines.{training[0]}.options.speculative.train co-trains a draft, but engines.{i} "
                              f"{why}: every group receives the same pushes, so all of them co-train one draft "
                              f"(the same speculative section) or none does")
    return DraftTrainer(first, seed=seed, device=cfg.trainer.parallel.device, vocab_size=vocab_size)
