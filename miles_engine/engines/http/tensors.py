"""Named tensors over JSON: base64 safetensors blobs (``load_format="miles_safetensors"``).

SGLang's ``/update_weights_from_tensor`` takes ``serialized_named_tensors`` as base64 strings
too, but each is a pickled ``MultiprocessingSerializer`` payload (CUDA-IPC handles; colocated
only). Unpickling network input runs arbitrary code, so our server accepts only safetensors
(plain bytes + a JSON header) and says so when it sees anything else.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from miles_engine.engines.http.wire import BadRequest

TENSOR_LOAD_FORMAT = "miles_safetensors"


def untied_cpu(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Contiguous CPU copies safetensors can write: tied weights (embed_tokens / lm_head share one
    storage in a tied model's export) become separate tensors."""
    import torch

    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, value in weights.items():
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def encode_named_tensors(weights: Mapping[str, Any], chunk_bytes: int = 256 << 20) -> list[str]:
    """Named tensors -> base64 safetensors blobs of at most about ``chunk_bytes`` each."""
    from safetensors.torch import save

    chunks: list[str] = []
    cur: dict[str, Any] = {}
    size = 0
    for name, t in untied_cpu(weights).items():
        if cur and size + t.numel() * t.element_size() > chunk_bytes:
            chunks.append(base64.b64encode(save(cur)).decode("ascii"))
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * t.element_size()
    if cur or not chunks:
        chunks.append(base64.b64encode(save(cur)).decode("ascii"))
    return chunks


def decode_named_tensors(chunks: Any) -> dict[str, Any]:
    from safetensors.torch import load

    if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
        raise BadRequest("serialized_named_tensors must be a list of base64 strings")
    out: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        try:
            tensors = load(base64.b64decode(chunk, validate=True))
        except Exception as exc:  # noqa: BLE001 - any decode failure is the caller's payload
            raise BadRequest(f"serialized_named_tensors[{i}] is not base64 safetensors ({exc.__class__.__name__}); "
                             f"pickled SGLang payloads are refused, use load_format='{TENSOR_LOAD_FORMAT}'") from None
        dup = out.keys() & tensors.keys()
        if dup:
            raise BadRequest(f"tensor {sorted(dup)[0]!r} appears in more than one chunk")
        out.update(tensors)
    return out


def load_directory(directory: Any, who: str) -> dict[str, Any]:
    """Every tensor of a directory's safetensors files (a full-precision update a client must
    convert before the server loads it); an empty directory is refused by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    from miles_engine.engines.errors import EngineRefusedUpdate

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise EngineRefusedUpdate(f"{who}: no *.safetensors file in {directory}")
    return {name: t for f in files for name, t in load_file(str(f)).items()}
