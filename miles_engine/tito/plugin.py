"""Built-in plugin: the ``qwen3``, ``glm`` and ``chatml`` chat families and the ``tito`` /
``tito-external`` agents, registered through the same hooks as third-party plugins."""

from __future__ import annotations

from pydantic import Field

from miles_engine import hookimpl
from miles_engine.components import Component, Section
from miles_engine.tito.families.chatml import ChatMLFamily
from miles_engine.tito.families.glm import GLMFamily
from miles_engine.tito.families.qwen3 import Qwen3Family
from miles_engine.tito.families.template import TemplateFamily, TemplateFamilyOptions


class ThinkingFamilyOptions(Section):
    enable_thinking: bool = Field(True, description="default reasoning mode (requests may override)")


class ChatMLOptions(Section):
    default_system: str | None = Field(None, description="system prompt used when a conversation has none")


def _qwen3(opts: ThinkingFamilyOptions):  # type: ignore[no-untyped-def]
    return Qwen3Family(**opts.model_dump())


def _glm(opts: ThinkingFamilyOptions):  # type: ignore[no-untyped-def]
    return GLMFamily(**opts.model_dump())


def _chatml(opts: ChatMLOptions):  # type: ignore[no-untyped-def]
    return ChatMLFamily(**opts.model_dump())


def _template(opts):  # type: ignore[no-untyped-def]
    return TemplateFamily(opts)


@hookimpl
def miles_register_chat_families() -> list[Component]:
    return [
        Component("qwen3", _qwen3, ThinkingFamilyOptions,
                  "Qwen3: ChatML + <think> reasoning + <tool_call>{json}</tool_call>"),
        Component("glm", _glm, ThinkingFamilyOptions,
                  "GLM-4.5+: [gMASK]<sop>, <|user|>/<|observation|> stop-and-open, XML tool calls"),
        Component("chatml", _chatml, ChatMLOptions, "plain ChatML (SmolLM2, tiny models), Hermes tool calls"),
        Component("template", _template, TemplateFamilyOptions,
                  "the model's own Jinja chat template, accepted once proven append-only on its tokenizer"),
    ]


@hookimpl
def miles_register_agents() -> list[Component]:
    from miles_engine.tito.agent import TitoAgent, TitoAgentOptions
    from miles_engine.tito.external import ExternalAgentOptions, ExternalHarnessAgent
    from miles_engine.tito.harness import HarnessAgent, HarnessAgentOptions

    return [
        Component("tito", TitoAgent, TitoAgentOptions,
                  "model-driven tool calling through a TITO session server's OpenAI API"),
        Component("tito-external", ExternalHarnessAgent, ExternalAgentOptions,
                  "runs a command-line harness against its own session (OPENAI_BASE_URL)"),
        Component("harness", HarnessAgent, HarnessAgentOptions,
                  "a coding-agent CLI (claude-code, codex, custom) inside the episode's sandbox against its own "
                  "session (Messages / Responses / chat), trajectories collected"),
    ]
