"""``trainer.megatron``: the parallel sizes of the Megatron backend (importable without torch),
checked against the world size and the model's shape with one error naming every problem."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.errors import ConfigError


class MegatronConfig(Section):
    tensor_parallel: int = Field(1, ge=1, description="TP: attention heads, MLP and vocab split over this many "
                                 "ranks (must divide the attention and key/value heads)")
    pipeline_parallel: int = Field(1, ge=1, description="PP: decoder layers split into this many stages "
                                   "(must divide the layers); micro-batches flow stage to stage")
    expert_parallel: int = Field(1, ge=1, description="EP (MoE models): experts split over this many "
                                 "data-parallel ranks (must divide the experts; pipeline_parallel=1)")
    sequence_parallel: bool = Field(False, description="SP: between the attention and MLP blocks each TP rank "
                                    "holds 1/tensor_parallel of the tokens (needs tensor_parallel > 1, "
                                    "pipeline_parallel=1)")
    checkpoint_format: Literal["hf", "dist"] = Field(
        "hf", description="hf: checkpoints gathered on rank 0 under Hugging Face names (the torch backend's "
        "format: resumable by either backend); dist: every rank writes its own shards in parallel in "
        "megatron-core's distributed format (torch_dist), resumable by this backend at any TP / PP / EP")
    context_parallel: int = Field(1, ge=1, description="not supported (refused unless 1): Megatron's context "
                                  "parallelism needs Transformer Engine attention")

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor_parallel * self.pipeline_parallel)

    def check(self, world_size: int, shape: Any | None = None, *, prefix: str = "trainer.megatron") -> int:
        """The data-parallel size; a :class:`ConfigError` naming every size that does not fit."""
        tp, pp, ep = self.tensor_parallel, self.pipeline_parallel, self.expert_parallel
        problems = []
        if world_size % (tp * pp):
            problems.append(f"world size {world_size} (trainer ranks) is not a multiple of {prefix}.tensor_parallel "
                            f"x {prefix}.pipeline_parallel = {tp} x {pp}")
        elif (world_size // pp) % (tp * ep):
            problems.append(f"{prefix}.expert_parallel={ep} x tensor_parallel={tp} must divide the {world_size // pp} "
                            f"ranks of a pipeline stage")
        if ep > 1 and pp > 1:
            problems.append(f"{prefix}.expert_parallel={ep} with pipeline_parallel={pp} is not supported (the "
                            f"pipeline's micro-batch loop does not keep expert-parallel ranks in step); "
                            f"use one of them")
        if self.sequence_parallel and (tp == 1 or pp > 1):
            problems.append(f"{prefix}.sequence_parallel=true needs tensor_parallel > 1 and pipeline_parallel=1 "
                            f"(got {tp} and {pp}): it splits the sequence over the TP ranks, and the pipeline's "
                            f"stage-to-stage transfers are not split")
        if self.context_parallel != 1:
            problems.append(f"{prefix}.context_parallel={self.context_parallel} is not supported: megatron-core's "
                            f"context parallelism needs Transformer Engine attention (not in the local layer spec "
                            f"this backend builds); use context_parallel=1")
        if shape is not None:
            if shape.heads % tp or shape.kv_heads % tp:
                problems.append(f"{prefix}.tensor_parallel={tp} must divide the model's {shape.heads} attention heads "
                                f"and {shape.kv_heads} key/value heads")
            if shape.layers % pp:
                problems.append(f"{prefix}.pipeline_parallel={pp} must divide the model's {shape.layers} layers")
            if ep > 1 and not shape.moe:
                problems.append(f"{prefix}.expert_parallel={ep} needs a MoE model ({shape.model_type} has no experts)")
            elif shape.moe and shape.experts % ep:
                problems.append(f"{prefix}.expert_parallel={ep} must divide the model's {shape.experts} experts")
        if problems:
            raise ConfigError("trainer.backend=megatron: " + "; ".join(problems))
        return world_size // (tp * pp)
