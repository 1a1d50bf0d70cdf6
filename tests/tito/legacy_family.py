"""A chat family that breaks the append-only rule on purpose, for tests of ``miles tito check``."""

from __future__ import annotations

from typing import Any


def legacy_qwen3_family(_options: Any = None) -> Any:
    """A deliberately *non-append-only* family for tests of the check: Qwen3's shipped rule
    that drops the reasoning of assistant turns before the last user message."""
    from miles_engine.tito.families.qwen3 import QWEN3_TEMPLATE, Qwen3Family

    template = QWEN3_TEMPLATE.replace(
        "{%- if message.reasoning_content is string %}",
        "{%- set ns = namespace(later_user=false) %}"
        "{%- for m in messages[loop.index0:] %}{%- if m.role == 'user' %}{%- set ns.later_user = true %}"
        "{%- endif %}{%- endfor %}"
        "{%- if message.reasoning_content is string and not ns.later_user %}",
    )

    class LegacyQwen3Family(Qwen3Family):
        name = "legacy-qwen3"

    LegacyQwen3Family.template = template
    return LegacyQwen3Family()
