"""Megatron's distributed checkpoint format (``trainer.megatron.checkpoint_format: dist``).

Every rank writes its own shards in parallel with ``megatron.core.dist_checkpointing`` (the
``torch_dist`` strategy) into ``SUBDIR`` of the run checkpoint being staged: the policy (and
reference) ``GPTModel.sharded_state_dict()``, and Adam's moments as sharded tensors that mirror
the parameters (``megatron.core.dist_checkpointing.optimizer``: ``optimizer.state.exp_avg.<param
key>``). Nothing passes through rank 0 or the driver but the small rest, which ``trainer.pt``
keeps: the scheduler(s), counters, the optimizer's hyper-parameters, the value head.

The sharded tensors carry their global shape and offsets, so a checkpoint loads into any other
TP / PP / EP layout (megatron-core reshards; the vocab-padded embedding rows are allowed to
differ). The torch backend cannot read it: :func:`check_backend` refuses that with one error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_engine.errors import ConfigError
from miles_engine.trainer.megatron import dist_writer

if TYPE_CHECKING:  # torch is imported where used: the driver checks a checkpoint's format without it
    import torch
    from torch import Tensor, nn

    from miles_engine.trainer.megatron.trainer import MegatronTrainer

SUBDIR = "megatron_dist"  # inside RUN_DIR/checkpoints/step_NNNNNNNN/
KIND = "megatron_dist"  # the trainer state's "format"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_dist(state: dict[str, Any]) -> bool:
    return state.get("format") == KIND


def check_backend(state: dict[str, Any], backend: str, where: Any) -> None:
    """One clear error when a backend that cannot read Megatron's format is given one."""
    if is_dist(state) and backend != "megatron":
        raise ConfigError(f"checkpoint {where} is in Megatron's distributed format (written with "
                          f"trainer.megatron.checkpoint_format=dist): only trainer.backend=megatron resumes it "
                          f"(any tensor/pipeline/expert parallel sizes). Resume with trainer.backend=megatron, or "
                          f"export it first (`miles export RUN_DIR DEST`) and start from that HF directory")


def _modules(tr: MegatronTrainer) -> dict[str, nn.Module]:
    out = {"policy": tr.policy.gpt}
    if tr.reference is not None:
        out["reference"] = tr.reference.gpt
    return out


def _model_sharded(tr: MegatronTrainer) -> dict[str, dict[str, Any]]:
    return {name: gpt.sharded_state_dict(prefix=f"{name}.") for name, gpt in _modules(tr).items()}


def _moments_sharded(tr: MegatronTrainer, opt: torch.optim.Optimizer, policy_sharded: dict[str, Any],
                     prefix: str, *, loading: bool) -> dict[str, dict[str, Any]]:
    """Adam's moments of the policy's parameters as sharded tensors mirroring the parameters
    (zeros as load targets when ``loading`` and the optimizer has not stepped yet)."""
    import torch
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    params = [p for g in opt.param_groups for p in g["params"]]
    by_id = get_param_id_to_sharded_param_map(policy_sharded, params)
    out: dict[str, dict[str, Any]] = {}
    for i, sharded in by_id.items():
        p = params[i]
        st = opt.state.get(p) or {}
        out[str(i)] = {k: make_sharded_optimizer_tensor(  # keyed by the local parameter (stacked layers share a key)
            sharded, st[k] if k in st and not loading else torch.zeros_like(p), prefix=f"{prefix}.state.{k}")
            for k in _MOMENTS}
    return out


def _policy_params(tr: MegatronTrainer) -> set[int]:
    return {id(p) for p in tr.policy.parameters()}


def _optimizer_common(tr: MegatronTrainer, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What is not sharded: hyper-parameters, Adam's step, the value head's (replicated) state."""
    policy = _policy_params(tr)
    stepped = [opt.state[p] for g in opt.param_groups for p in g["params"] if id(p) in policy and p in opt.state]
    other = {}
    if tr.value_head is not None:
        for n, p in tr.value_head.named_parameters():
            if p in opt.state:
                other[n] = {k: v.detach().cpu().clone() for k, v in opt.state[p].items()}
    return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "step": stepped[0]["step"].detach().cpu().clone() if stepped else None,
            "value_head": other}


def _optimizers(tr: MegatronTrainer) -> dict[str, torch.optim.Optimizer]:
    out = {"optimizer": tr.optimizer}
    if tr._sft_opt and tr._sft_opt[0] is not tr.optimizer:
        out["sft_optimizer"] = tr._sft_opt[0]
    return out


def save(tr: MegatronTrainer, directory: str | Path) -> dict[str, Any]:
    """Every rank writes its shards under ``directory`` (a collective); the small rest, for
    ``trainer.pt`` (rank 0's is the one kept)."""
    from megatron.core import dist_checkpointing

    dist_writer.enable()
    model = _model_sharded(tr)
    sharded: dict[str, Any] = {"model": model, "moments": {}}
    common = {}
    for name, opt in _optimizers(tr).items():
        c = _optimizer_common(tr, opt)
        common[name] = {"groups": c["groups"], "step": c["step"], "value_head": c["value_head"]}
        if c["step"] is not None:
            sharded["moments"][name] = _moments_sharded(tr, opt, model["policy"], name, loading=False)
    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(directory), sharded_strategy=("torch_dist", 1))
    state = {"format": KIND, "dist_checkpoint": SUBDIR, "model": {}, "optimizer": common["optimizer"],
             "scheduler": tr.scheduler.state_dict(), "weight_version": tr.weight_version,
             "rl_steps": tr.rl_steps, "sft_steps": tr.sft_steps,
             "megatron_layout": {"tp": tr.layout.tp, "pp": tr.layout.pp, "ep": tr.layout.ep}}
    if tr.value_head is not None:
        state["value_head"] = {k: v.detach().cpu().clone() for k, v in tr.value_head.state_dict().items()}
    if "sft_optimizer" in common:
        state.update(sft_optimizer=common["sft_optimizer"], sft_scheduler=tr._sft_opt[1].state_dict())
    return state


def _restore_optimizer(tr: MegatronTrainer, opt: torch.optim.Optimizer, common: dict[str, Any],
                       moments: dict[str, dict[str, Tensor]] | None) -> None:
    for group, saved in zip(opt.param_groups, common["groups"]):
        group.update(saved)
    if common["step"] is None:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    if not moments:
        raise ConfigError("Megatron distributed checkpoint: the optimizer stepped but its moments are missing")
    for i, loaded in moments.items():  # keyed by the parameter's index in the optimizer (see _moments_sharded)
        p = params[int(i)]
        opt.state[p] = {"step": common["step"].clone(), **{k: loaded[k].to(p.device) for k in _MOMENTS}}
    if tr.value_head is not None:
        for n, p in tr.value_head.named_parameters():
            if n in common["value_head"]:
                opt.state[p] = {k: v.to(p.device) if v.dim() else v.clone() for k, v in common["value_head"][n].items()}


def load(tr: MegatronTrainer, state: dict[str, Any]) -> None:
    """Every rank reads its shards (in this rank's layout, whatever the writer's) and the rest."""
    import torch
    from megatron.core import dist_checkpointing

    directory = state.get("dist_checkpoint_path")
    if not directory or not (Path(directory) / "metadata.json").is_file():
        raise ConfigError(f"Megatron distributed checkpoint {directory!r} is missing or incomplete (no "
                          f"metadata.json): resume from another checkpoint")
    model = _model_sharded(tr)
    request: dict[str, Any] = {"model": model, "moments": {}}
    saved_opts = {"optimizer": state["optimizer"]}
    if "sft_optimizer" in state:
        opt, sched = tr.sft_optimizer()
        if opt is tr.optimizer:
            raise ConfigError("checkpoint has an SFT optimizer but trainer.sft.optimizer is not configured")
        saved_opts["sft_optimizer"] = state["sft_optimizer"]
    opts = {"optimizer": tr.optimizer, **({"sft_optimizer": tr._sft_opt[0]} if "sft_optimizer" in state else {})}
    for name, common in saved_opts.items():
        if common["step"] is not None:
            request["moments"][name] = _moments_sharded(tr, opts[name], model["policy"], name, loading=True)
    loaded = dist_checkpointing.load(request, str(directory), sharded_strategy=None)
    with torch.no_grad():
        for name, gpt in _modules(tr).items():
            tensors = {k.removeprefix(f"{name}."): v for k, v in loaded["model"][name].items()}
            params = dict(gpt.named_parameters())
            for k, p in params.items():
                p.copy_(tensors[k])
    if tr.value_head is not None and "value_head" in state:
        tr.value_head.load_state_dict(state["value_head"])
    for name, common in saved_opts.items():
        _restore_optimizer(tr, opts[name], common, loaded["moments"].get(name))
    tr.scheduler.load_state_dict(state["scheduler"])
    if "sft_scheduler" in state:
        tr._sft_opt[1].load_state_dict(state["sft_scheduler"])
    tr.weight_version = int(state["weight_version"])
    tr.rl_steps, tr.sft_steps = int(state.get("rl_steps", 0)), int(state.get("sft_steps", 0))


def load_policy(tr: MegatronTrainer, directory: str) -> None:
    """Only the policy's weights of a distributed checkpoint (conversion: see :mod:`.convert`)."""
    import torch
    from megatron.core import dist_checkpointing

    model = {"policy": tr.policy.gpt.sharded_state_dict(prefix="policy.")}
    loaded = dist_checkpointing.load({"model": model}, directory)
    with torch.no_grad():
        tensors = {k.removeprefix("policy."): v for k, v in loaded["model"]["policy"].items()}
        for k, p in tr.policy.gpt.named_parameters():
            p.copy_(tensors[k])
