"""Templates of ``miles new plugin --kind reward``."""

from miles_engine.scaffold import readme

FILES = {
    "README.md": readme("""
Use it in a recipe:

```yaml
reward:
  components:
    - {name: $name, weight: 1.0, options: {keyword: done}}
```
"""),
    "PACKAGE/plugin.py": '''\
"""Registers the `$name` reward."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.environments.protocol import EpisodeContext, RewardResult


class ${cls}Options(BaseModel):
    """Options of `$name`; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")
    keyword: str = Field("done", min_length=1, description="text the final answer must contain")
    ignore_case: bool = True


def final_answer(transcript: Any) -> str | None:
    """The last assistant message with text; a transcript may hold anything, so check every step."""
    if not isinstance(transcript, list):
        return None
    for message in reversed(transcript):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, str) and content.strip():
                return content
    return None


class ${cls}Reward:
    """1.0 when the final answer contains the keyword, else 0.0. Never raises: a verifier that
    cannot score returns ``RewardResult.failed(reason)``."""

    deterministic = True

    def __init__(self, options: ${cls}Options) -> None:
        self.options = options

    async def score(self, episode: EpisodeContext) -> RewardResult:
        answer = final_answer(getattr(episode, "transcript", None))
        if answer is None:
            return RewardResult(reward=0.0, info={"answered": False})
        keyword, text = self.options.keyword, answer
        if self.options.ignore_case:
            keyword, text = keyword.lower(), text.lower()
        return RewardResult(reward=float(keyword in text), info={"answered": True})


@hookimpl
def miles_register_rewards() -> list[Component]:
    return [Component("$name", ${cls}Reward, options=${cls}Options,
                      description="1 when the final answer contains a keyword")]
''',
    "tests/test_contract.py": '''\
"""`$name` passes the reward contract suite (plugin registered programmatically: no install needed)."""

from miles_engine.testing.reward import RewardContract, SampleEpisode


def said(text):
    return [{"role": "user", "content": "Are you finished?"}, {"role": "assistant", "content": text}]


class Test${cls}Contract(RewardContract):
    component = "$name"
    plugin = "$package.plugin"
    options = {"keyword": "done"}
    deterministic = True

    def sample_episodes(self):
        return [
            SampleEpisode("keyword", said("All DONE."), expected=1.0),
            SampleEpisode("no keyword", said("still working"), expected=0.0),
            SampleEpisode("silent", [], expected=0.0),
        ]
''',
}
