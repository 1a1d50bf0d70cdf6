"""``disk_delta`` weight transport: versioned, verified byte patches under a shared directory.

- :mod:`.layout`: ``weight_vNNNNNN/`` directories and the index (written last, atomically).
- :mod:`.codec`: canonical bytes, ``xor`` / ``overwrite`` deltas, zstandard, checksums.
- :mod:`.baseline`: version 0, the canonical safetensors checkpoint, and the trainer's check.
- :mod:`.publisher`: trainer side (per-source parts, replica check, commit).
- :mod:`.chain` / :mod:`.applier`: engine side (lineage, pull, patch, verify, short pause).
- :mod:`.retention`: engine leases and garbage collection.
- :mod:`.engine_server` / :mod:`.remote`: ``apply_on=engine``: our engine server pulls and applies
  itself (``POST /update_weights_from_disk_delta``), the trainer only tells it the version.
- :mod:`.local_copy`: an engine's full copy persisted on its host, so a restart after garbage
  collection resumes from it instead of the (removed) start of the chain.
- :mod:`.transport`: :class:`DiskDeltaTransport`, the ``disk_delta`` choice of ``weights.transport``.

Importing this package imports neither torch nor numpy; the submodules do.
"""

from miles_engine.weights.disk_delta.options import DiskDeltaOptions

__all__ = ["DiskDeltaOptions"]
