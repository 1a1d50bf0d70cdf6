"""``engines.N.options`` of ``kind: vllm`` (vLLM's own serving options, typed) and where vLLM lives."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles_engine.components import Section

MIN_VLLM = (0, 32)  # the first vLLM with the RL routes and weight-transfer API this kind drives
PYTHON_ENV = "MILES_VLLM_PYTHON"
WORKER_EXTENSION = "miles_vllm_bridge.worker.MilesWorkerExtension"  # the bridge's, on the servers' PYTHONPATH


def default_python() -> str:
    """``$MILES_VLLM_PYTHON``, else the environment ``./dev.sh vllm`` builds next to this checkout."""
    env = os.environ.get(PYTHON_ENV)
    if env:
        return env
    return str(Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python")


_NEEDS_MODEL = ("draft_model", "eagle", "eagle3")


class VllmSpeculativeOptions(Section):
    """vLLM's speculative decoding, passed as ``--speculative-config`` (keys of vLLM's
    ``SpeculativeConfig``). Only exact methods are offered: vLLM's standard rejection sampler
    keeps the policy's distribution and reports the policy's log-probs (its ``synthetic``
    rejection method, which does not, is not reachable from here). vLLM 0.32's CPU runner
    speculates too (n-gram proposals with numba, draft and EAGLE models with their KV on CPU),
    so no method is refused on ``device: cpu``."""

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=32, description="tokens proposed per step")
    model: str | None = Field(None, description="the draft / EAGLE head (draft_model, eagle, eagle3: required; "
                              "mtp: default the policy's own MTP layers)")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest suffix matched")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest suffix matched")
    draft_tensor_parallel_size: int | None = Field(None, ge=1, description="draft model's tensor parallel size")
    train: bool = Field(False, description="not offered: see the error")

    @model_validator(mode="after")
    def _consistent(self) -> VllmSpeculativeOptions:
        if self.train:
            raise ValueError("train: true (a co-trained draft) is not offered for vllm engines: vLLM loads its draft "
                             "from `model` at start and its weight-transfer API updates the policy's weights only; "
                             "co-train a draft with kind embedded or server")
        lookup = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
        if lookup and self.method != "ngram":
            raise ValueError(f"prompt_lookup_min/max are read by method 'ngram' only, not {self.method!r}")
        if (self.prompt_lookup_min or 0) > (self.prompt_lookup_max or 1 << 30):
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method in _NEEDS_MODEL and not self.model:
            raise ValueError(f"method {self.method!r} needs model (the draft model's or EAGLE head's directory)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("method 'ngram' takes no model (the sequence is its own draft)")
        return self

    def config_json(self) -> str:
        """The ``--speculative-config`` value."""
        return json.dumps(self.model_dump(exclude_none=True, exclude={"train"}), sort_keys=True)


class VllmKindOptions(Section):
    python: str | None = Field(None, description="the Python of vLLM's own environment (default: $MILES_VLLM_PYTHON, "
                               "else .venv-vllm/bin/python of this checkout, built by ./dev.sh vllm)")
    model_path: str | None = Field(None, description="a Hugging Face directory (default: the policy, saved once)")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's, on CUDA devices")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="KV cache per server on a CPU device "
                                    "(VLLM_CPU_KVCACHE_SPACE; vLLM's own default takes most of the RAM)")
    port: int | None = Field(None, ge=1, le=65535, description="replica i listens on port + i (default: a free port each)")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt + completion (default: the model's)")
    max_num_seqs: int | None = Field(None, ge=1, description="most sequences decoded at once")
    enforce_eager: bool = Field(True, description="no torch.compile / CUDA graphs (starts in a fraction of the time)")
    enable_prefix_caching: bool = True
    speculative: VllmSpeculativeOptions | None = Field(None, description="speculative decoding (vLLM's "
                                                       "--speculative-config)")
    extra_args: list[str] = Field(default_factory=list, description="passed to vLLM's server verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server processes")
    start_timeout_s: float = Field(600.0, gt=0, description="deadline for a server to answer /health")
    max_restarts: int = Field(3, ge=0, description="consecutive failed restarts before the engine gives up")
    health_interval_s: float = Field(5.0, gt=0)
    max_request_retries: int = Field(3, ge=0, description="re-sends of a request whose server died")

    @field_validator("extra_args")
    @classmethod
    def _no_raw_speculation(cls, args: list[str]) -> list[str]:
        if any(str(a).startswith("--speculative") for a in args):
            raise ValueError("speculative decoding is set with options.speculative (typed, checked), not with "
                             "--speculative-config in extra_args")
        return args

    def devices_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def python_path(self) -> str:
        return self.python or default_python()
