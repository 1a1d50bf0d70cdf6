"""JSON on the session server's wire: orjson when installed (the reports carry every token
id and log-prob of an episode; the stdlib encoder was ~8% of a training driver's time),
the stdlib otherwise. Both write NaN/inf as ``null`` (strict JSON, unlike ``json.dumps``)."""

from __future__ import annotations

import json
import math
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson ships with the server extra
    orjson = None  # type: ignore[assignment]


def _strict(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    return json.dumps(_strict(obj), ensure_ascii=False, allow_nan=False).encode()


def loads(data: bytes | str) -> Any:
    return orjson.loads(data) if orjson is not None else json.loads(data)
