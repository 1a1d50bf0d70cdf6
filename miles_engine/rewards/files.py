"""Harbor's reward files, read as Harbor's ``Verifier`` reads them (shared by the ``harbor``
environment and the ``test-script`` / ``reward-file`` reward components).

``test.sh`` writes ``/logs/verifier/reward.json`` (a flat ``{name: number}`` map) or
``/logs/verifier/reward.txt`` (one float). ``reward.json`` wins when both exist; a text file
becomes ``{"reward": x}``. Harbor keeps the whole map as ``VerifierResult.rewards``; miles
needs one scalar, chosen by :func:`scalar_reward`:

1. the ``"reward"`` entry when the map has one (what every ``reward.txt`` task produces);
2. else the only entry of a one-entry map (Harbor's metrics also take a single key's value
   whatever its name);
3. else the mean of all entries (what Harbor's default ``Mean`` metric reports per key, averaged).

Every entry is kept in ``RewardResult.components``. An empty file, a non-number, NaN/inf, a JSON
value that is not a number (booleans included) or an empty map is a :class:`RewardError`
naming the task and the file; the caller turns it into ``RewardResult.failed`` (never a crash).
"""

from __future__ import annotations

import json
import math
from typing import Any

from miles_engine.environments.protocol import RewardResult
from miles_engine.errors import RewardError

VERIFIER_DIR = "/logs/verifier"
REWARD_JSON = f"{VERIFIER_DIR}/reward.json"
REWARD_TXT = f"{VERIFIER_DIR}/reward.txt"
TEST_STDOUT = f"{VERIFIER_DIR}/test-stdout.txt"
MAX_REWARD_FILE_BYTES = 1 << 20


def _shown(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _finite(value: float, *, where: str, name: str) -> float:
    if not math.isfinite(value):
        raise RewardError(f"{where}: reward {name!r} is {value}, not a finite number")
    return value


def parse_reward_txt(data: bytes, *, where: str) -> dict[str, float]:
    """``reward.txt`` → ``{"reward": x}``."""
    if not data:
        raise RewardError(f"{where}: reward file is empty")
    text = data.decode("utf-8", errors="replace")
    try:
        value = float(text.strip())
    except ValueError:
        raise RewardError(f"{where}: reward file does not hold one number: {_shown(text.strip())}") from None
    return {"reward": _finite(value, where=where, name="reward")}


def parse_reward_json(data: bytes, *, where: str) -> dict[str, float]:
    """``reward.json`` → a flat ``{name: number}`` map."""
    if not data:
        raise RewardError(f"{where}: reward file is empty")
    try:
        raw: Any = json.loads(data.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        raise RewardError(f"{where}: reward file is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise RewardError(f"{where}: reward file must hold a JSON object of name → number, got {type(raw).__name__}")
    if not raw:
        raise RewardError(f"{where}: reward file holds an empty object (no rewards)")
    out: dict[str, float] = {}
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RewardError(
                f"{where}: reward {name!r} must be a number, got {type(value).__name__} {_shown(json.dumps(value))}"
            )
        out[name] = _finite(float(value), where=where, name=name)
    return out


def scalar_reward(rewards: dict[str, float]) -> float:
    """One scalar from Harbor's reward map (see the module docstring for the rule)."""
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    return sum(rewards.values()) / len(rewards)


def reward_result(rewards: dict[str, float], *, source: str, **info: Any) -> RewardResult:
    return RewardResult(reward=scalar_reward(rewards), components=dict(rewards), info={"reward_file": source, **info})


def reward_paths(verifier_dir: str) -> tuple[str, str]:
    """``(reward.json, reward.txt)`` inside ``verifier_dir``."""
    base = verifier_dir.rstrip("/") or "/"
    return f"{base}/reward.json", f"{base}/reward.txt"


def find_rewards_command(verifier_dir: str) -> str:
    """A shell command printing each existing reward file of ``verifier_dir``, one per line."""
    import shlex

    paths = " ".join(shlex.quote(p) for p in reward_paths(verifier_dir))
    return f'for f in {paths}; do if [ -f "$f" ]; then echo "$f"; fi; done'


def clear_rewards_command(verifier_dir: str) -> str:
    """A shell command creating ``verifier_dir`` and removing stale reward files from it."""
    import shlex

    paths = " ".join(shlex.quote(p) for p in reward_paths(verifier_dir))
    return f"mkdir -p {shlex.quote(verifier_dir)} && rm -f {paths}"


async def read_reward_files(sandbox: Any, verifier_dir: str, *, where: str) -> tuple[str, dict[str, float]] | None:
    """Read ``reward.json`` (preferred) or ``reward.txt`` from ``verifier_dir`` in ``sandbox``.

    :return: ``(path, rewards)``, or ``None`` when neither file exists.
    :raises RewardError: a file exists but breaks the rules above.
    """
    json_path, txt_path = reward_paths(verifier_dir)
    found = (await sandbox.exec(find_rewards_command(verifier_dir), timeout_s=30)).stdout.split()
    path = json_path if json_path in found else txt_path if txt_path in found else None
    if path is None:
        return None
    data = await sandbox.read_file(path, max_bytes=MAX_REWARD_FILE_BYTES)
    parse = parse_reward_json if path == json_path else parse_reward_txt
    return path, parse(data, where=f"{where}: {path}")
