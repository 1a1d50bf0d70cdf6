"""A torch trainer's whole state as a checkpoint holds it (``TorchTrainer.state_dict`` /
``load_state_dict``): parameter-name keyed, so it loads into either backend."""

from __future__ import annotations

from typing import Any

from miles_engine.trainer import lora
from miles_engine.trainer.optimizer_stream import all_resident


def full_state(trainer: Any) -> dict[str, Any]:
    opts = [trainer.optimizer] + ([trainer._sft_opt[0]] if trainer._sft_opt else [])
    with all_resident(getattr(trainer, "streams", {}).values()):  # trainer.optimizer_state=disk
        model_sd, optim_sds = trainer.comm.full_state(trainer.root, opts)
    if trainer.config.lora.enabled:  # the frozen base (and the reference) come back from the model source
        model_sd = {k: v for k, v in model_sd.items()
                    if lora.is_adapter_key(k) or not k.startswith(("policy.", "reference."))}
    state = {"format": 1, "model": model_sd, "optimizer": optim_sds[0], "scheduler": trainer.scheduler.state_dict(),
             "weight_version": trainer.weight_version, "rl_steps": trainer.rl_steps, "sft_steps": trainer.sft_steps}
    if trainer._sft_opt:
        state.update(sft_optimizer=optim_sds[1], sft_scheduler=trainer._sft_opt[1].state_dict())
    return state


def load_full_state(trainer: Any, state: dict[str, Any]) -> None:
    pairs = [(trainer.optimizer, state.get("optimizer") or {})]
    if "sft_optimizer" in state:
        opt, sched = trainer.sft_optimizer()
        if opt is trainer.optimizer:
            raise ValueError("checkpoint has an SFT optimizer but trainer.sft.optimizer is not configured")
        pairs.append((opt, state["sft_optimizer"] or {}))
        sched.load_state_dict(state["sft_scheduler"])
    with all_resident(getattr(trainer, "streams", {}).values()):  # written back to the files on exit
        trainer.comm.load_full_state(trainer.root, state.get("model") or {}, pairs,
                                     strict=not trainer.config.lora.enabled)
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.weight_version = int(state["weight_version"])
    trainer.rl_steps, trainer.sft_steps = int(state.get("rl_steps", 0)), int(state.get("sft_steps", 0))


def full_tensors(trainer: Any) -> dict[str, Any]:
    """On every rank: the policy's full tensors under the HF names, as ``named_tensors`` exports them
    (LoRA merged), each rank gathering every shard (an all-gather per tensor under FSDP2, in one order
    on every rank), so every rank can be a p2p source."""
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
             for k, v in trainer.policy.state_dict().items()}
    if trainer.config.lora.enabled:
        state = lora.engine_tensors(state, trainer.config.lora.scaling)
    return state


def named_tensors(trainer: Any, dtype: Any = None) -> Any:
    """:meth:`TorchTrainer.named_tensors`: the policy's state now (a collective under FSDP, not when
    iterated), merged LoRA weights or the adapters' parts as ``trainer.lora.push`` says."""
    cfg = trainer.config.lora
    state = trainer.comm.model_state(trainer.policy)
    if cfg.enabled and cfg.push == "adapters":  # float32: the engine merges them
        return lora.adapter_export(state, cfg.scaling)
    if cfg.enabled:
        state = lora.engine_tensors(state, cfg.scaling)
    return iter([(name, t.to(dtype) if dtype is not None else t) for name, t in state.items()])
