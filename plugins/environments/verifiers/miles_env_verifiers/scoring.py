"""Score a miles episode with the verifiers task's own rewards, metrics and judges.

The episode's messages become a verifiers ``Trace`` (prompt nodes unsampled, the agent's
assistant turns sampled, tool results in between) and ``Task.score(trace, runtime=None)`` runs
exactly as in a verifiers rollout. Signals that need a verifiers runtime (a ``runtime``
parameter without a default) cannot run here; rather than scoring silently without them (what
verifiers does offline), the episode's reward is refused, naming them.
"""

from __future__ import annotations

import inspect
from typing import Any

from miles_engine.environments.protocol import Message, RewardResult

from miles_env_verifiers.messages import to_verifiers


def runtime_only_signals(task: Any) -> list[str]:
    def needs_runtime(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    names = [fn.__name__ for fn in (*task.hooks("metric"), *task.hooks("reward")) if needs_runtime(fn)]
    names += [judge.reward_name for judge in task.plugged_judges() if needs_runtime(judge.score)]
    return names


def build_trace(task: Any, messages: list[Message], tools: list[dict[str, Any]], agent_name: str) -> Any:
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import Tool

    nodes = []
    for i, message in enumerate(messages):
        node = MessageNode(parent=i - 1 if i else None, message=to_verifiers(message),
                           sampled=bool(message.get("_sampled")))
        if i == 0 and tools:
            node.tools = [Tool(name=t["name"], description=t["description"], parameters=t["parameters"])
                          for t in tools]
        nodes.append(node)
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                  agent=AgentInfo(config=AgentConfig(), name=agent_name), nodes=nodes)
    trace.ok = True
    trace.stop("agent_completed")
    return trace


async def score_episode(task: Any, messages: list[Message], tools: list[dict[str, Any]],
                        agent_name: str = "miles") -> RewardResult:
    blocked = runtime_only_signals(task)
    if blocked:
        return RewardResult.failed(f"verifiers task {type(task).__name__} scores with {blocked}, which need a "
                                   "verifiers runtime (a sandbox box); the miles adapter scores without one")
    trace = build_trace(task, messages, tools, agent_name)
    try:
        await task.score(trace, runtime=None)
    except Exception as exc:  # verifiers wraps scoring failures in TaskError
        return RewardResult.failed(f"verifiers scoring of {type(task).__name__} failed: {type(exc).__name__}: {exc}")
    missing = [name for name, r in trace.rewards.items() if r is None]
    if missing:
        return RewardResult.failed(f"verifiers scoring left rewards {missing} unscored")
    components = {name: r.score for name, r in trace.rewards.items() if r is not None}
    metrics = {name: v for name, v in trace.metrics.items() if v is not None}
    weights = {name: r.weight for name, r in trace.rewards.items() if r is not None}
    return RewardResult(reward=float(trace.reward), components=components,
                        info={"metrics": metrics, "weights": weights, "trace_id": trace.id})
