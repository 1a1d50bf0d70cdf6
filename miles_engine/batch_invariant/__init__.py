"""True on-policy numerics: batch-invariant versions of a causal LM's ops, shared by the
rollout engine and the trainer (``trainer.true_on_policy``), so both compute every token's
log-prob with the same arithmetic whatever the batch, padding, cache or micro-batch.

    from miles_engine.batch_invariant import enable, log_softmax
    enable(model)            # in place; both sides call it on their own copy of the model
"""

from miles_engine.batch_invariant.ops import elementwise, linear, log_softmax, rms_norm, row_blocks, softmax
from miles_engine.batch_invariant.patch import check_supported, enable, is_enabled, replayed_scores

__all__ = ["check_supported", "elementwise", "enable", "is_enabled", "linear", "log_softmax", "replayed_scores",
           "rms_norm", "row_blocks", "softmax"]
