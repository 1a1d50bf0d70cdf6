"""SGLang's speculative decoding options, typed (importable without the HTTP client)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SGLangSpeculativeOptions(BaseModel):
    """SGLang's speculative decoding, typed (``--speculative-*`` flags of ``srt/server_args.py``).
    The keys recipes used with the raw mapping (algorithm, draft_model_path, num_steps,
    eagle_topk, num_draft_tokens) keep their names. Only exact settings are offered: SGLang's
    ``--speculative-accept-threshold-*`` (< 1 accepts tokens the policy would not sample) are
    not reachable from here, and ``extra_args`` may not carry ``--speculative-*`` flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"] = Field(
        description="EAGLE / EAGLE3 (a draft head), NEXTN (the model's own MTP layers), STANDALONE (a small "
        "draft model), NGRAM (no model; CUDA only)")
    draft_model_path: str | None = Field(None, description="EAGLE, EAGLE3, STANDALONE: required")
    num_steps: int | None = Field(None, ge=1, description="drafting depth")
    eagle_topk: int | None = Field(None, ge=1, description="branching per drafting step")
    num_draft_tokens: int | None = Field(None, ge=1, description="tokens verified per step")
    ngram_min_match_window_size: int | None = Field(None, ge=1, description="NGRAM: shortest suffix matched")
    ngram_max_match_window_size: int | None = Field(None, ge=1, description="NGRAM: longest suffix matched")
    train: bool = Field(False, description="not offered: see the error")

    @field_validator("algorithm", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> SGLangSpeculativeOptions:
        if self.train:
            raise ValueError("train: true (a co-trained draft) is not offered for sglang engines here: this kind "
                             "pushes the policy's weights only (SGLang's draft worker is loaded from "
                             "draft_model_path at start); co-train a draft with kind embedded or server")
        ngram = self.ngram_min_match_window_size is not None or self.ngram_max_match_window_size is not None
        if self.algorithm == "NGRAM":
            if self.draft_model_path or self.num_steps or self.eagle_topk:
                raise ValueError("algorithm NGRAM takes no draft_model_path, num_steps or eagle_topk (the sequence "
                                 "is its own draft; set num_draft_tokens and the ngram_* window sizes)")
        elif ngram:
            raise ValueError(f"ngram_*_match_window_size are read by algorithm NGRAM only, not {self.algorithm}")
        elif self.algorithm != "NEXTN" and not self.draft_model_path:
            raise ValueError(f"algorithm {self.algorithm} needs draft_model_path")
        lo, hi = self.ngram_min_match_window_size, self.ngram_max_match_window_size
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"ngram_min_match_window_size ({lo}) is larger than ngram_max_match_window_size ({hi})")
        return self

    def flags(self) -> list[str]:
        out: list[str] = []
        for key, value in self.model_dump(exclude_none=True, exclude={"train"}).items():
            out += [f"--speculative-{key.replace('_', '-')}", str(value)]
        return out


def speculative_options(value: SGLangSpeculativeOptions | Mapping[str, Any] | None) -> SGLangSpeculativeOptions | None:
    """The typed options from a recipe's mapping (the raw-flag keys recipes used still work);
    an empty mapping is off."""
    if value is None or isinstance(value, SGLangSpeculativeOptions):
        return value
    if not value:
        return None
    try:
        return SGLangSpeculativeOptions.model_validate(dict(value))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "speculative"
        raise ValueError(f"sglang speculative option {where}: {first.get('msg')} (known keys: "
                         f"{', '.join(SGLangSpeculativeOptions.model_fields)})") from None
