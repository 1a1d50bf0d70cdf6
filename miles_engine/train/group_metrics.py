"""Per-step rollout metrics computed from the groups a step trained on."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from miles_engine.rollout.types import Group


def group_metrics(groups: Sequence[Group]) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajs if t.reward is not None]
    out: dict[str, float] = {"rollout/num_samples": float(len(trajs)), "rollout/num_groups": float(len(groups))}
    if rewards:
        out.update({"reward/mean": statistics.fmean(rewards), "reward/min": min(rewards),
                    "reward/max": max(rewards)})
    by_kind: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        if t.reward is not None and "kind" in t.tags:
            by_kind[t.tags["kind"]].append(t.reward)
    out.update({f"reward/{kind}": statistics.fmean(v) for kind, v in sorted(by_kind.items())})
    for key, name in (("tool_use", "rollout/tool_use_rate"), ("turns", "rollout/turns"),
                      ("generation_s", "time/generation"), ("reward_s", "time/reward"),
                      ("episode_s", "rollout/episode_s"), ("tito_mismatch_bug", "tito/mismatch_bug_rate"),
                      ("truncated", "rollout/truncated_rate")):
        values = [t.metrics[key] for t in trajs if key in t.metrics]
        if values:
            out[name] = statistics.fmean(values)
    # tito/mismatch_rate/<type> and tito/mismatch_bug_rate/<wire format> (chat, messages, responses)
    for prefix, name in (("tito_mismatch_type/", "tito/mismatch_rate/"),
                         ("tito_mismatch_wire/", "tito/mismatch_bug_rate/")):
        keys = sorted({k for t in trajs for k in t.metrics if k.startswith(prefix)})
        for key in keys:
            out[name + key[len(prefix):]] = statistics.fmean(t.metrics[key] for t in trajs if key in t.metrics)
    # session_server.diagnose_every: the mismatch rate is over the diagnosed trajectories only
    out["tito/diagnosed"] = float(sum("tito_mismatch_bug" in t.metrics for t in trajs))
    sampled = [t.num_sampled for t in trajs]
    if sampled:
        out["rollout/sampled_tokens"] = statistics.fmean(sampled)
    # a failed attempt kept with reward 0.0 has status "ok" and tags["failure"]
    out["rollout/failed"] = float(sum(t.status != "ok" or "failure" in t.tags for t in trajs))
    return out
