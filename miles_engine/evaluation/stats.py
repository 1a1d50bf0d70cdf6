"""Statistics of an evaluation: pure functions over per-task attempt outcomes.

The unit of sampling is the *task*: an eval draws tasks from a population, and every score is
a mean over tasks of a per-task value (its mean reward, its pass@k estimate). Standard errors
and the 95% bootstrap intervals resample tasks with replacement, so attempts of one task are
never treated as independent draws.

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
Trained on Code"): with ``n`` scored attempts of which ``c`` passed,
``pass@k = 1 - C(n - c, k) / C(n, k)`` (defined for ``k <= n``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_RESAMPLES = 2000
CONFIDENCE = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: ``n`` scored attempts, ``c`` of them passed."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n attempts, got n={n}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i): the numerically stable form of the binomial ratio
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation, ddof=1, over sqrt(n))."""
    n = len(values)
    if n < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1) / n)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default ``linear`` method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_interval(values: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (tasks resampled with replacement)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(math.fsum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    alpha = (1.0 - confidence) / 2
    return _percentile(means, alpha), _percentile(means, 1.0 - alpha)


@dataclass(frozen=True)
class Estimate:
    """A mean over tasks with its standard error and 95% bootstrap interval."""

    value: float
    se: float
    low: float
    high: float
    n: int  # tasks it is computed over

    def metrics(self, name: str) -> dict[str, float]:
        return {name: self.value, f"{name}_se": self.se, f"{name}_ci_low": self.low, f"{name}_ci_high": self.high}

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "se": self.se, "ci_low": self.low, "ci_high": self.high, "tasks": self.n}


def estimate(values: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Estimate:
    low, high = bootstrap_interval(values, resamples=resamples, seed=seed)
    return Estimate(mean(values), standard_error(values), low, high, len(values))


@dataclass(frozen=True)
class TaskOutcome:
    """The scored attempts of one task (errored attempts are not here: they are not scores)."""

    task_id: str
    rewards: tuple[float, ...]
    passed: tuple[bool, ...]
    errors: int = 0

    @property
    def n(self) -> int:
        return len(self.rewards)

    @property
    def c(self) -> int:
        return sum(self.passed)

    def mean_reward(self) -> float:
        return mean(self.rewards)


def summarize(outcomes: Sequence[TaskOutcome], ks: Sequence[int], *, resamples: int = DEFAULT_RESAMPLES,
              seed: int = 0) -> dict[str, Estimate]:
    """``reward`` and ``pass@k`` for each ``k`` over the tasks with at least one (for pass@k: at
    least ``k``) scored attempt."""
    scored = [o for o in outcomes if o.n > 0]
    out = {"reward": estimate([o.mean_reward() for o in scored], resamples=resamples, seed=seed)}
    for k in sorted(set(ks)):
        values = [pass_at_k(o.n, o.c, k) for o in scored if o.n >= k]
        out[f"pass@{k}"] = estimate(values, resamples=resamples, seed=seed)
    return out


def paired_difference(a: Mapping[str, float], b: Mapping[str, float], *, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = 0) -> Estimate:
    """``a - b`` over the tasks both evaluated (per-task values keyed by task id): the mean
    difference with its standard error and bootstrap interval over the shared tasks."""
    shared = sorted(set(a) & set(b))
    return estimate([a[t] - b[t] for t in shared], resamples=resamples, seed=seed)
