"""``sglang``: SGLang servers launched by the run (GPU machines; the ``sglang`` extra).

Under ``precision.rollout=fp8`` the servers load the policy as the contract's fine-grained FP8
checkpoint (written once per run, :mod:`miles_engine.engines.fp8_checkpoint`; SGLang reads its
``quantization_config``), and each push ships the quantizer's codes and tile scales under the
checkpoint's names (``W`` as ``float8_e4m3fn``, ``W_scale_inv``), which SGLang's weight loaders
take as they take the checkpoint's."""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.engines.fleet.config import EngineGroupConfig, SGLangKindOptions
from miles_engine.engines.fleet.kinds import SGLANG_PAUSE_REFUSED, FleetContext
from miles_engine.errors import ConfigError


class SGLangKind:
    in_process = False
    transports = ("broadcast",)  # SGLang's /update_weights_from_distributed; it has no disk-delta route
    pause_modes_refused = SGLANG_PAUSE_REFUSED

    def __init__(self, options: SGLangKindOptions) -> None:
        self.options = options

    @staticmethod
    def precision_refusal(weight_format: str, kv_cache: str, group: EngineGroupConfig) -> str | None:
        return precision_refusal(weight_format, kv_cache, group)

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        from miles_engine.engines.sglang import SGLangLaunchConfig, SGLangServer

        o = self.options
        model = o.model_path or (ctx.model if isinstance(ctx.model, str) else None)
        held, extra = None, list(o.extra_args)  # SGLang does not publish what it holds: under fp8 the checkpoint says
        if ctx.weight_format == "fp8":  # the policy as an instance or a spec is written as a checkpoint here
            model, held = await asyncio.to_thread(fp8_policy, o.model_path, ctx, group.dtype)
            if not o.model_path and "--skip-tokenizer-init" not in extra:
                extra.append("--skip-tokenizer-init")  # the written checkpoint has no tokenizer: we send token ids
        if model is None:
            raise ConfigError(f"engine group '{name}' (kind sglang) needs a model directory: set model.path or "
                              f"engines.N.options.model_path (SGLang loads Hugging Face directories)")
        if o.speculative is not None and o.speculative.algorithm == "NGRAM" and not group.device.startswith("cuda"):
            raise ConfigError(f"engine group '{name}' (kind sglang): speculative algorithm NGRAM runs on CUDA only "
                              f"in SGLang; this group's device is {group.device}")
        servers = []
        for i in range(group.replicas):
            env = dict(ctx.env or os.environ)
            if group.device.startswith("cuda"):  # each replica its own tp x dp devices (expert parallelism shares them)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, group.replica_cuda_devices(i, o.tp_size * o.dp_size)))
            cfg = SGLangLaunchConfig(model_path=model, tp_size=o.tp_size, dp_size=o.dp_size, ep_size=o.ep_size,
                                     dtype=group.dtype, mem_fraction_static=o.mem_fraction_static,
                                     speculative=o.speculative,
                                     extra_args=extra, env=env, start_timeout_s=o.start_timeout_s,
                                     log_path=ctx.state_dir / f"{name}-{i}.log")
            server = SGLangServer(cfg, name=f"{name}-{i}", moe_shape=ctx.routed_experts_shape(), held=held)
            stack.push_async_callback(server.stop)
            servers.append(server)
        return list(await asyncio.gather(*(s.start() for s in servers)))


def precision_refusal(weight_format: str, kv_cache: str, group: EngineGroupConfig) -> str | None:
    """Why an sglang engine group cannot keep this precision contract (None: it can)."""
    from miles_engine.engines.fp8_checkpoint import server_refusal

    why = server_refusal(
        "sglang", weight_format, kv_cache, group.dtype, kv_flag="--kv-cache-dtype fp8_e4m3",
        formats_why="SGLang loads fine-grained FP8 checkpoints as the quantizer writes them; its MXFP8 / NVFP4 "
                    "(ModelOpt) paths quantise activations too and read other layouts, its INT4 schemes round by "
                    "other rules")
    if why is None and weight_format == "fp8" and not group.device.startswith("cuda"):
        why = ("precision.rollout='fp8' on device cpu: SGLang receives each pushed tensor in its own dtype over "
               "the weight-sync group, and gloo (the CPU backend) cannot carry float8_e4m3fn (torch: Invalid "
               "scalar type); NCCL can: put the group on cuda")
    return why


def fp8_policy(model_path: str | None, ctx: FleetContext, dtype: str) -> tuple[str, list[Any]]:
    """The FP8 checkpoint the servers load (``options.model_path`` when it was written under this
    contract, else the policy's, written once) and what they then hold in ``dtype`` (the push's metadata)."""
    from miles_engine.engines.fp8_checkpoint import check_model_path, held_metadata, policy_checkpoint

    if model_path:
        check_model_path(model_path, ctx.weight_exceptions)
        directory = model_path
    else:
        directory = policy_checkpoint(ctx.model, ctx.state_dir / "sglang-model-fp8", ctx.weight_exceptions, "sglang")
    return directory, held_metadata(directory, dtype)
