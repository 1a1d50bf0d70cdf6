"""``vllm``: vLLM servers launched by the run on loopback from vLLM's own environment
(``options.python``) and supervised like ``server`` engines: a server that dies or hangs is
restarted with the trainer's current weights and version, the requests it held re-sent. Weights
reach them over the broadcast transport, through vLLM's weight-transfer API into the bridge's
``miles`` backend (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from contextlib import AsyncExitStack
from functools import lru_cache
from pathlib import Path
from typing import Any

from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import VLLM_PAUSE_REFUSED, FleetContext
from miles_engine.engines.vllm.options import MIN_VLLM, PYTHON_ENV, WORKER_EXTENSION, VllmKindOptions
from miles_engine.errors import ConfigError

BRIDGE = Path(__file__).resolve().parents[1] / "vllm" / "bridge"
LAUNCH = BRIDGE / "miles_vllm_bridge" / "launch.py"


@lru_cache(maxsize=8)
def vllm_version(python: str) -> tuple[int, ...]:
    """The vLLM version importable by ``python``; one ConfigError saying what is wrong otherwise."""
    where = f"engines.N.options.python={python!r}"
    fix = f"build vLLM's environment with ./dev.sh vllm, or point {PYTHON_ENV} / options.python at one"
    if not Path(python).is_file():
        raise ConfigError(f"{where}: no such file; {fix}")
    try:
        res = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{where}: cannot run it ({exc}); {fix}") from None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"{where} cannot import vllm ({last}); {fix}")
    text = res.stdout.strip().splitlines()[-1]
    version = tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())
    if version < MIN_VLLM:
        raise ConfigError(f"{where} has vLLM {text}, older than {'.'.join(map(str, MIN_VLLM))}: the RL routes "
                          f"(/pause, /update_weights, /collective_rpc) and the weight-transfer API this kind drives "
                          f"came later; {fix}")
    return version


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def hf_directory(ctx: FleetContext) -> str:
    """A Hugging Face directory of the policy vLLM can load: the policy's own, else (a GGUF file, a
    ``package:`` or ``tiny:`` spec) the model loaded once and saved under the run's engine state;
    under ``precision.rollout=fp8`` the policy's FP8 checkpoint (:mod:`miles_engine.engines.fp8_checkpoint`)."""
    if ctx.weight_format == "fp8":
        from miles_engine.engines.fp8_checkpoint import policy_checkpoint

        return policy_checkpoint(ctx.model, ctx.state_dir / "vllm-model-fp8", ctx.weight_exceptions, "vllm")
    path = ctx.model_path()
    if (Path(path) / "config.json").is_file():
        return path
    out = ctx.state_dir / "vllm-model"
    if not (out / "config.json").is_file():
        import shutil

        from miles_engine.models.loading import load_model

        tmp = ctx.state_dir / "vllm-model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        load_model(path, dtype="float32")[0].save_pretrained(str(tmp), safe_serialization=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)


class VllmKind:
    in_process = False
    transports = ("broadcast",)
    pause_modes_refused = VLLM_PAUSE_REFUSED

    def __init__(self, options: VllmKindOptions) -> None:
        self.options = options

    @staticmethod
    def precision_refusal(weight_format: str, kv_cache: str, group: EngineGroupConfig) -> str | None:
        return precision_refusal(weight_format, kv_cache, group.dtype)

    def command(self, group: EngineGroupConfig, ctx: FleetContext, index: int, model: str) -> list[str]:
        o = self.options
        argv = [o.python_path(), str(LAUNCH), "--model", model, "--served-model-name", "policy",
                "--skip-tokenizer-init", "--dtype", group.dtype, "--seed", str(ctx.seed + index),
                "--logprobs-mode", logprobs_mode(o), "--worker-extension-cls", WORKER_EXTENSION,
                "--weight-transfer-config", json.dumps({"backend": "miles"}),
                "--tensor-parallel-size", str(o.tensor_parallel_size),
                "--pipeline-parallel-size", str(o.pipeline_parallel_size),
                "--data-parallel-size", str(o.data_parallel_size)]
        if o.port is not None:
            argv += ["--port", str(o.port + index)]
        if o.max_model_len is not None:
            argv += ["--max-model-len", str(o.max_model_len)]
        if o.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(o.max_num_seqs)]
        if o.gpu_memory_utilization is not None and group.device.startswith("cuda"):
            argv += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
        argv += ["--enforce-eager"] if o.enforce_eager else []
        argv += ["--enable-prefix-caching"] if o.enable_prefix_caching else ["--no-enable-prefix-caching"]
        if o.speculative is not None:
            argv += ["--speculative-config", o.speculative.config_json()]
        return [*argv, *o.extra_args]

    def environment(self, group: EngineGroupConfig, ctx: FleetContext, index: int) -> dict[str, str]:
        o = self.options
        env = dict(ctx.env or os.environ)
        env.update(o.env)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the RL routes: /pause, /update_weights, /collective_rpc...
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BRIDGE), env.get("PYTHONPATH")) if p)
        if group.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, group.replica_cuda_devices(index, o.devices_per_replica())))
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{o.cpu_kv_cache_gib:g}"
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        return env

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        from miles_engine.engines.supervisor import SupervisedEngine
        from miles_engine.engines.vllm.client import VllmEngine

        o = self.options
        if ctx.true_on_policy:
            raise ConfigError(f"engine group '{name}' (kind vllm): trainer.true_on_policy needs batch-invariant "
                              f"arithmetic identical to the trainer's, which only our engines compute; vLLM's "
                              f"kernels differ (the mismatch correction, trainer.mismatch, handles the gap)")
        refuse_precision(group, name, ctx)
        await asyncio.to_thread(vllm_version, o.python_path())
        if o.port is not None:
            busy = [o.port + i for i in range(group.replicas) if port_in_use(o.port + i)]
            if busy:
                raise ConfigError(f"engine group '{name}' (kind vllm): options.port={o.port} gives replica ports "
                                  f"{o.port}..{o.port + group.replicas - 1}, and 127.0.0.1:{busy[0]} is in use; "
                                  f"pick free ports or leave options.port unset (a free port each)")
        if o.model_path and ctx.weight_format == "fp8":
            from miles_engine.engines.fp8_checkpoint import check_model_path

            check_model_path(o.model_path, ctx.weight_exceptions)
        model = o.model_path or await asyncio.to_thread(hf_directory, ctx)
        engines = []
        for i in range(group.replicas):
            ename = f"{name}-{i}"
            engines.append(SupervisedEngine(
                self.command(group, ctx, i, model), name=ename, state_dir=ctx.state_dir / ename,
                env=self.environment(group, ctx, i), start_timeout_s=o.start_timeout_s,
                max_restarts=o.max_restarts, health_interval_s=o.health_interval_s,
                max_request_retries=o.max_request_retries, restore=ctx.restore, client_factory=VllmEngine,
                client_kwargs={"per_request_seeds": group.device.startswith("cuda"),
                               "raw_logprobs": logprobs_mode(o) == "raw_logprobs"}))
        for engine in engines:
            stack.push_async_callback(engine.aclose)
        await asyncio.gather(*(e.start() for e in engines))
        return engines


def precision_refusal(weight_format: str, kv_cache: str, dtype: str) -> str | None:
    """Why a vllm engine group cannot keep this precision contract (None: it can)."""
    from miles_engine.engines.fp8_checkpoint import server_refusal

    return server_refusal(
        "vllm", weight_format, kv_cache, dtype, kv_flag="--kv-cache-dtype fp8",
        formats_why="vLLM loads fine-grained FP8 checkpoints as the quantizer writes them and computes them on CPU "
                    "(AMX, bfloat16 activations) and CUDA; its NVFP4 (ModelOpt) and MXFP8 kernels are CUDA-only and "
                    "quantise activations too, its INT4 schemes (GPTQ / AWQ) round by other rules")


def refuse_precision(group: EngineGroupConfig, name: str, ctx: FleetContext) -> None:
    why = precision_refusal(ctx.weight_format, ctx.kv_cache, group.dtype)
    if why is not None:
        raise ConfigError(f"engine group '{name}' (kind vllm): {why}")


def logprobs_mode(options: VllmKindOptions) -> str:
    """vLLM's log-probs after temperature / top-p / top-k (what the protocol records), except under
    speculation: vLLM 0.32's rejection sampler returns NaN for some accepted tokens in that mode
    (measured on its CPU build: 8 of 240 tokens at T = 1 with n-gram proposals; its raw mode had
    none), so speculative servers record raw log-probs -- the same values at temperature 0 or 1
    without top-p / top-k, which the client then requires (:class:`~miles_engine.engines.vllm.client.VllmEngine`)."""
    return "raw_logprobs" if options.speculative is not None else "processed_logprobs"
