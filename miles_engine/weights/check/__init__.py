"""check-weight-update-equal: prove a weight transport delivers every tensor, bit for bit.

    transport = CheckedTransport(create_transport("broadcast", engines), engines, CheckOptions())

Before the first push every engine tensor the trainer exports is overwritten with random data
(so a tensor the transport forgets cannot happen to equal the trainer's); after every push each
exported tensor is compared with the trainer's copy on every engine, and one
:class:`WeightCheckError` names each tensor that differs (with its max abs diff) or was never
written. Recipes: ``weights.check_update_equal: true`` (``weights.check_tolerance`` for quantised
engines; semantics in :mod:`.options`). Importing this package does not import torch.
"""

from __future__ import annotations

from miles_engine.weights.check.errors import WeightCheckError
from miles_engine.weights.check.options import CheckOptions, CheckTolerance

__all__ = ["CheckOptions", "CheckTolerance", "WeightCheckError"]
