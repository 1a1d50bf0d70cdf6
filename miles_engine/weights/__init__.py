"""Weight transports: move the trainer's weights into the rollout engines under a version.

    transport = create_transport("broadcast", engines, bucket_bytes=64 << 20)
    stats = await transport.push(model.named_parameters(), version=step + 1)   # -> PushStats
    await transport.close()

- ``colocated``: engines in this process (:class:`ColocatedTransport`).
- ``broadcast``: engine processes over a torch.distributed group (:class:`BroadcastTransport`).
- ``disk_delta``: versioned byte patches under a shared directory (:mod:`.disk_delta`).
- ``p2p``: every trainer rank writes to its planned engines point to point (:mod:`.p2p`).

Every push ends by checking that each engine reports the pushed version
(:class:`WeightPushError` otherwise). ``check=CheckOptions()`` wraps any transport in
check-weight-update-equal (:mod:`.check`). Importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from miles_engine.errors import unknown_name
from miles_engine.weights.protocol import PushStats, WeightPushError, WeightTransport, verify_versions

TRANSPORTS: dict[str, str] = {
    "colocated": "miles_engine.weights.colocated:ColocatedTransport",
    "broadcast": "miles_engine.weights.broadcast:BroadcastTransport",
    "disk_delta": "miles_engine.weights.disk_delta.transport:DiskDeltaTransport",
    "p2p": "miles_engine.weights.p2p:P2PTransport",
}

__all__ = ["TRANSPORTS", "PushStats", "WeightPushError", "WeightTransport", "create_transport", "transport_class",
           "verify_versions"]


def transport_class(name: str) -> type:
    if name not in TRANSPORTS:
        raise unknown_name("weight transport", name, TRANSPORTS)
    module, _, attr = TRANSPORTS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def create_transport(name: str, engines: Any, *, check: Any = None, **options: Any) -> WeightTransport:
    """Build the transport ``name`` for ``engines`` (an engine, a list, or a router); with
    ``check`` (a :class:`~miles_engine.weights.check.CheckOptions`) every push is verified
    tensor by tensor against the trainer's copy."""
    transport = transport_class(name)(engines, **options)
    if check is None:
        return transport
    from miles_engine.weights.check.transport import CheckedTransport

    return CheckedTransport(transport, engines, check)
