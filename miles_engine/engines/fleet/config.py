"""The recipe's ``engines`` section: a list of engine groups, and each built-in kind's options.

    engines:
      - kind: server          # embedded | server | sglang | external | a plugin's kind
        replicas: 2
        device: cpu           # cpu, cuda, cuda:N
        dtype: float32
        options: {max_batch_size: 64}

Each kind's ``options`` are validated by the kind's own model (registered through the hub
with ``miles_register_engines``), so a bad key names ``engines.N.options.KEY``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from miles_engine.components import Section
from miles_engine.engines.embedded.options import SpeculativeOptions
from miles_engine.engines.sglang_options import SGLangSpeculativeOptions

_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


class EngineGroupConfig(Section):
    """One group of identical engines behind the router."""

    kind: str = Field("embedded", description="engine kind: embedded (in the driver process), server (`miles "
                      "serve` processes launched and supervised by the run), sglang (SGLang servers launched by "
                      "the run), external (URLs someone else runs), or a plugin's kind")
    name: str | None = Field(None, description="group name in metrics and logs (default: the kind, numbered "
                             "when several groups share it)")
    replicas: int = Field(1, ge=1, description="engines in this group")
    device: str = Field("cpu", description="cpu, cuda or cuda:N (replicas of a cuda group take cuda:0, cuda:1, "
                        "... unless the device names one)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    options: dict = Field(default_factory=dict, description="the kind's own options")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {value!r}")
        return value

    def replica_device(self, index: int) -> str:
        return f"cuda:{index}" if self.device == "cuda" and self.replicas > 1 else self.device

    def replica_cuda_devices(self, index: int, per_replica: int) -> list[int]:
        """The CUDA device indices replica ``index`` owns when each replica spans ``per_replica``
        devices (tensor x pipeline x data parallel): disjoint, from ``cuda:N`` (0 for ``cuda``) on."""
        first = int(self.device.partition(":")[2] or 0)
        return list(range(first + index * per_replica, first + (index + 1) * per_replica))


class EmbeddedKindOptions(Section):
    max_batch_size: int = Field(64, ge=1, description="most sequences decoded in one step")
    threads: int = Field(1, ge=1, description="torch threads of the engine's decode thread")
    prompt_cache_tokens: int = Field(
        1 << 15, ge=0, description="the engine's shared-prompt cache: a GRPO group's attempts prefill their "
        "prompt once (token budget; 0 off)")
    gil_switch_interval_ms: float | None = Field(
        0.5, gt=0, le=100,
        description="the driver process's sys.setswitchinterval while an engine's decode thread shares its GIL "
        "with the event loop (Python's default is 5 ms: every socket, pipe or file call of the loop then "
        "waits up to that long for the GIL behind a forward pass); None leaves it alone")
    speculative: SpeculativeOptions = Field(default_factory=SpeculativeOptions,
                                            description="speculative decoding (exact), see docs/speculative.md")


class ServerKindOptions(Section):
    max_batch_size: int = Field(64, ge=1)
    threads: int = Field(1, ge=1, description="torch threads of each engine process")
    prompt_cache_tokens: int = Field(1 << 15, ge=0)
    start_timeout_s: float = Field(120.0, gt=0, description="deadline for a process to answer /health")
    max_restarts: int = Field(5, ge=0, description="consecutive failed restarts before the engine gives up")
    health_interval_s: float = Field(2.0, gt=0, description="health probe period of each engine process")
    max_request_retries: int = Field(3, ge=0, description="re-sends of a request whose engine died")
    engine_factory: str | None = Field(None, description="module:function building each process's engine "
                                       "(default: the embedded engine)")
    speculative: SpeculativeOptions = Field(default_factory=SpeculativeOptions,
                                            description="speculative decoding of each engine process (exact)")


class SGLangKindOptions(Section):
    model_path: str | None = Field(None, description="default: model.path")
    tp_size: int = Field(1, ge=1)
    dp_size: int = Field(1, ge=1)
    ep_size: int = Field(1, ge=1)
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    speculative: SGLangSpeculativeOptions | None = Field(None, description="SGLang's speculative decoding "
                                                         "(--speculative-* flags)")
    extra_args: list[str] = Field(default_factory=list, description="passed to sglang.launch_server verbatim")

    @field_validator("extra_args")
    @classmethod
    def _no_raw_speculation(cls, args: list[str]) -> list[str]:
        if any(str(a).startswith("--speculative") for a in args):
            raise ValueError("speculative decoding is set with options.speculative (typed, checked), not with "
                             "--speculative-* flags in extra_args")
        return args
    start_timeout_s: float = Field(900.0, gt=0)


class ExternalKindOptions(Section):
    urls: list[str] = Field(min_length=1, description="base URLs of the servers (never launched, restarted or "
                            "killed by the run); replicas must equal their number")
    api: Literal["sglang", "vllm", "miles"] = Field(
        "sglang", description="what they speak: sglang (SGLang), miles (our engine server: SGLang's API and more), "
        "vllm (vLLM's OpenAI server with VLLM_SERVER_DEV_MODE=1; weights need the miles bridge, docs/vllm.md)")
    connect_timeout_s: float = Field(10.0, gt=0, description="each URL must answer /health within this at start")

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"{url!r} is not an http(s):// URL")
        return [u.rstrip("/") for u in urls]


class FleetConfig(Section):
    """How the router treats the fleet (the ``fleet`` recipe section)."""

    health_interval_s: float = Field(2.0, gt=0, description="router health-check period")
    fail_threshold: int = Field(2, ge=1, description="failed checks before an engine is quarantined")
    readmit_after: int = Field(2, ge=1, description="good checks before a quarantined engine is re-admitted")
    unhealthy_timeout_s: float = Field(
        300.0, gt=0, description="the run stops with one error once no engine has been healthy this long")
