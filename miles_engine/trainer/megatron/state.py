"""Checkpoints of the Megatron backend in the torch backend's format: model tensors and Adam
moments under ``policy.<HF name>`` (``reference.``, ``value_head.``), parameter groups listing
those names, scheduler and counters as they are. Adam is element-wise, so the moments map
through :mod:`.hf_mapping` exactly like the weights: a checkpoint written by either backend (any
TP / PP / EP) resumes on the other, and the model part *is* an HF state dict
(:func:`miles_engine.trainer.megatron.convert.to_hf_dir` writes it as a model directory).
This is ``trainer.megatron.checkpoint_format: hf`` (the default); ``dist``: :mod:`.dist_checkpoint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from miles_engine.trainer.megatron import hf_mapping as hm

if TYPE_CHECKING:
    from miles_engine.trainer.megatron.trainer import MegatronTrainer

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _opt_param_names(tr: MegatronTrainer, opt: torch.optim.Optimizer) -> list[list[str]]:
    """Per parameter group, the checkpoint name of each parameter in the HF order (tied: the
    embedding only, as torch's optimizer state dict lists a shared parameter once)."""
    names = []
    for g in opt.param_groups:
        ids = {id(p) for p in g["params"]}
        if any(id(p) in ids for p in tr.policy.parameters()):
            hf = [n for n in hm.hf_names(tr.shape) if not (tr.shape.tied and n == "lm_head.weight")]
            names.append([f"policy.{n}" for n in hf])
        else:
            names.append([f"value_head.{n}" for n, _ in tr.value_head.named_parameters()])
    return names


def _optimizer_state(tr: MegatronTrainer, opt: torch.optim.Optimizer) -> dict[str, Any]:
    gpt_params = dict(tr.policy.gpt.named_parameters())
    stepped = all(p in opt.state for p in gpt_params.values())
    state: dict[str, dict[str, Any]] = {}
    if stepped:
        full = {k: tr._gathered({n: opt.state[p][k] for n, p in gpt_params.items()}, tr.shape) for k in _MOMENTS}
        step = next(iter(opt.state[p] for p in gpt_params.values()))["step"]
        for name in full["exp_avg"]:
            if tr.shape.tied and name == "lm_head.weight":
                continue
            state[f"policy.{name}"] = {"step": step.clone(), **{k: full[k][name] for k in _MOMENTS}}
    if tr.value_head is not None:
        for n, p in tr.value_head.named_parameters():
            if p in opt.state:
                state[f"value_head.{n}"] = {k: v.detach().cpu().clone() for k, v in opt.state[p].items()}
    groups = []
    for g, names in zip(opt.param_groups, _opt_param_names(tr, opt)):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def _load_optimizer(tr: MegatronTrainer, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    if not saved:
        return
    st = saved.get("state", {})
    index: dict[nn.Parameter, int] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            index[p] = len(index)
    out: dict[int, dict[str, Any]] = {}
    gpt_params = dict(tr.policy.gpt.named_parameters())
    hf = hm.hf_names(tr.shape)
    if all(f"policy.{n}" in st for n in hf if not (tr.shape.tied and n == "lm_head.weight")):
        def moment(k: str) -> dict[str, Tensor]:
            m = {n: st[f"policy.{n}"][k] for n in hf if f"policy.{n}" in st}
            if tr.shape.tied:
                m["lm_head.weight"] = m["model.embed_tokens.weight"]
            return hm.to_megatron(m, tr.shape, tr.layout)

        local = {k: moment(k) for k in _MOMENTS}
        step = st[f"policy.{hf[0]}"]["step"]
        for n, p in gpt_params.items():
            out[index[p]] = {"step": step.clone(), **{k: local[k][n].to(p.device) for k in _MOMENTS}}
    if tr.value_head is not None:
        for n, p in tr.value_head.named_parameters():
            if f"value_head.{n}" in st:
                out[index[p]] = {k: v.to(p.device) if v.dim() else v for k, v in st[f"value_head.{n}"].items()}
    groups = [{**{k: v for k, v in sg.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
              for sg, g in zip(saved["param_groups"], opt.param_groups)]
    opt.load_state_dict({"state": out, "param_groups": groups})


def state_dict(tr: MegatronTrainer) -> dict[str, Any]:
    model = {f"policy.{k}": v for k, v in tr.hf_state(tr.policy).items()}
    if tr.reference is not None:
        model.update({f"reference.{k}": v for k, v in tr.hf_state(tr.reference).items()})
    if tr.value_head is not None:
        model.update({f"value_head.{k}": v.detach().cpu().clone() for k, v in tr.value_head.state_dict().items()})
    state = {"format": 1, "model": model, "optimizer": _optimizer_state(tr, tr.optimizer),
             "scheduler": tr.scheduler.state_dict(), "weight_version": tr.weight_version,
             "rl_steps": tr.rl_steps, "sft_steps": tr.sft_steps}
    if tr._sft_opt:
        state.update(sft_optimizer=_optimizer_state(tr, tr._sft_opt[0]), sft_scheduler=tr._sft_opt[1].state_dict())
    return state


def _module_state(model: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix)}


def load_state_dict(tr: MegatronTrainer, state: dict[str, Any]) -> None:
    model = state.get("model") or {}
    for key, module in (("policy.", tr.policy), ("reference.", tr.reference)):
        sd = _module_state(model, key)
        if module is not None and sd:
            if tr.shape.tied:
                sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
            tr._load_params(module.gpt, sd, tr.shape)
    if tr.value_head is not None and _module_state(model, "value_head."):
        tr.value_head.load_state_dict(_module_state(model, "value_head."))
    _load_optimizer(tr, tr.optimizer, state.get("optimizer") or {})
    if "sft_optimizer" in state:
        opt, sched = tr.sft_optimizer()
        if opt is tr.optimizer:
            raise ValueError("checkpoint has an SFT optimizer but trainer.sft.optimizer is not configured")
        _load_optimizer(tr, opt, state["sft_optimizer"] or {})
        sched.load_state_dict(state["sft_scheduler"])
    tr.scheduler.load_state_dict(state["scheduler"])
    tr.weight_version = int(state["weight_version"])
    tr.rl_steps, tr.sft_steps = int(state.get("rl_steps", 0)), int(state.get("sft_steps", 0))
