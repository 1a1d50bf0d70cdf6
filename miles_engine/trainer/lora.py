"""LoRA adapters on the trainer's policy (``trainer.lora``), through peft.

Adapters are injected in place (``peft.inject_adapter_in_model``): the policy keeps its class
and forward, only the targeted linears gain ``lora_A`` / ``lora_B`` and the base weight moves to
``<module>.base_layer.weight``. Only adapter parameters train. What the engines receive is what
changed: the merged weight ``W + scaling * B @ A`` of each adapted module, under the module's
Hugging Face name, or (``push``) only its A, B and scaling for an engine that keeps its base and
merges them itself (:mod:`miles_engine.models.adapters`); the frozen rest never moves. Checkpoints hold the adapter tensors only
(plus the optimizer over them). peft is imported only when LoRA is on.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.models import adapters

ADAPTER = "default"
_ADAPTER_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


class LoraOptions(Section):
    """``trainer.lora``: low-rank adapters instead of full fine-tuning."""

    enabled: bool = Field(False, description="train LoRA adapters only (the base weights stay frozen)")
    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input during SFT steps (RL "
                                                        "steps run without dropout: old and new log-probs agree)")
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names (suffixes) to adapt, or 'all-linear'")
    seed: int = Field(0, description="seed of the adapters' random init (B starts at zero either way)")
    push: Literal["merged", "adapters"] = Field(
        "merged", description="what the engines receive after a step (a recipe derives it from weights.lora): the "
        "merged W + scaling * B @ A of every adapted module, or the adapters alone")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise RuntimeError("trainer.lora needs peft: pip install 'miles-engine[lora]' "
                           "(pip install --no-deps peft keeps the installed torch)") from exc
    return peft


def apply(model: Any, opts: LoraOptions) -> Any:
    """Inject adapters into ``model`` in place; freeze everything else. Returns the model."""
    import torch

    peft = _require_peft()
    config = peft.LoraConfig(r=opts.rank, lora_alpha=opts.alpha, lora_dropout=opts.dropout,
                             target_modules=opts.target_modules, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts.seed)
        try:
            model = peft.inject_adapter_in_model(config, model)
        except ValueError as exc:  # "Target modules {...} not found in the base model"
            raise ValueError(f"trainer.lora.target_modules: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    model.eval()
    return model


def enabled(model: Any) -> bool:
    return any(is_adapter_key(n) for n, _ in model.named_parameters())


def is_adapter_key(name: str) -> bool:
    return _ADAPTER_KEY.search(name) is not None


def adapted_modules(state: dict[str, Any]) -> list[str]:
    """Module paths that carry an adapter (``model.layers.0.self_attn.q_proj``)."""
    return sorted({k.split(".lora_A.")[0] for k in state if ".lora_A." in k})


def engine_tensors(state: dict[str, Any], scaling: float) -> dict[str, Any]:
    """From a full policy state dict (peft names): the merged weights of the adapted modules under
    their Hugging Face names - all that differs from the base model the engines loaded."""
    out: dict[str, Any] = {}
    for module in adapted_modules(state):
        base = state[f"{module}.base_layer.weight"]
        a, b = state[f"{module}.lora_A.{ADAPTER}.weight"], state[f"{module}.lora_B.{ADAPTER}.weight"]
        out[f"{module}.weight"] = adapters.merge(base, a, b, scaling).to(base.dtype)
    return out


def adapter_export(state: dict[str, Any], scaling: float) -> adapters.AdapterExport:
    """What an engine that keeps its base needs instead (``trainer.lora.push=adapters``): each
    adapted module's A, B and scaling under ``<HF name>:lora.*``, with the trainer's bases to check against."""
    pairs: list[tuple[str, Any]] = []
    bases = {}
    for module in adapted_modules(state):
        weight = f"{module}.weight"
        pairs += adapters.to_parts(weight, state[f"{module}.lora_A.{ADAPTER}.weight"],
                                   state[f"{module}.lora_B.{ADAPTER}.weight"], scaling)
        bases[weight] = state[f"{module}.base_layer.weight"]
    return adapters.AdapterExport(pairs, bases)


def adapter_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if is_adapter_key(k)}


def adapter_file_state(state: dict[str, Any]) -> dict[str, Any]:
    """Adapter tensors under peft's ``adapter_model.safetensors`` names
    (``base_model.model.<module>.lora_A.weight``)."""
    return {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": v for k, v in adapter_state(state).items()}


@contextlib.contextmanager
def sft_dropout(model: Any, opts: LoraOptions) -> Iterator[None]:
    """Adapter dropout on during an SFT step (only the adapters' dropout modules switch mode)."""
    drops = [m for n, m in model.named_modules() if ".lora_dropout." in f"{n}." and opts.dropout > 0] \
        if opts.enabled else []
    for m in drops:
        m.train()
    try:
        yield
    finally:
        for m in drops:
            m.eval()
