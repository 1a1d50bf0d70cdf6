"""``fully_async`` vs ``sync`` rollouts on a long-tail episode mix (prints tables; not a test).

    .venv/bin/python bench/async_vs_sync.py           # full: 3 seeds x (async, sync), 12 steps each
    .venv/bin/python bench/async_vs_sync.py --quick   # smoke: 1 seed x (async, sync), 4 steps each (< 3 min)
    .venv/bin/python bench/async_vs_sync.py --latency pareto --pareto-alpha 1.2 --steps 16
    .venv/bin/python bench/async_vs_sync.py --on-update retract in_place abort wait   # partial rollouts

Figure 2 of issue 5. The ``tiny-terminal`` recipe as shipped (echo + two-turn calc drills, 8x8
samples per step, trainer in its own process, max staleness 2), except:

- 64 episodes in flight (the recipe has 32: fine for its CPU-bound drills, too few for slow tools).
- the environment is ``longtail-drills``, defined **here** and loaded by dotted path
  (``environment.name=bench.async_vs_sync:make_longtail_drills``; core is untouched): the
  ``shell-drills`` source whose tasks delay every tool call by a heavy-tailed latency
  (default lognormal, median 0.3 s, sigma 1.5, capped at 15 s: mean ~0.9 s, p99 ~10 s), as slow
  tools (test suites, package installs, remote APIs) do. The k-th load of a task id draws the
  same delays in every run, so A and B see the same latency sequence for the same task stream.
- a short SFT warm start is done once and shared (so the policy actually calls ``bash``; learning
  is not measured), and runs differ only in ``rollout.mode`` (and, with ``--on-update``, in what a
  push does to the requests running under ``fully_async``: ``rollout.on_update``).

Per run (each a fresh ``miles train`` process, ``run.max_minutes`` 2): steps/s over steps 3..N,
trainer idle fraction = sum(time/wait) / wall time over the same steps, the step-time split,
episode times, staleness and drops; then medians, ranges and the ratio fully_async/sync.
Runs are interleaved (async, sync, async, sync, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from miles_env_terminal_tasks.drills.options import DrillOptions
from miles_env_terminal_tasks.drills.source import ShellDrillsSource
from pydantic import Field


# ====================================================================================== the environment
class LongTailOptions(DrillOptions):
    """``shell-drills`` options plus the injected tool latency."""

    latency: Literal["lognormal", "pareto", "none"] = "lognormal"
    latency_median_s: float = Field(0.3, ge=0, description="lognormal: median delay")
    latency_sigma: float = Field(1.5, ge=0, description="lognormal: sigma of log(delay)")
    pareto_alpha: float = Field(1.3, gt=0, description="pareto: tail index (smaller = heavier)")
    pareto_scale_s: float = Field(0.1, gt=0, description="pareto: minimum delay")
    latency_cap_s: float = Field(15.0, gt=0, description="no delay is longer than this")
    latency_seed: int = 0
    latency_log: str | None = Field(None, description="append each drawn delay (JSON line) to this file")


class LongTailDrills(ShellDrillsSource):
    def __init__(self, options: LongTailOptions) -> None:
        super().__init__(options, name="longtail-drills")
        self.lt = options
        self._loads: Counter[str] = Counter()

    def draw(self, rng: random.Random) -> float:
        o = self.lt
        if o.latency == "none":
            return 0.0
        if o.latency == "lognormal":
            delay = o.latency_median_s * math.exp(o.latency_sigma * rng.gauss(0.0, 1.0))
        else:
            delay = o.pareto_scale_s * (1.0 - rng.random()) ** (-1.0 / o.pareto_alpha)
        return min(delay, o.latency_cap_s)

    def load_task(self, task_id: str) -> Any:
        task = super().load_task(task_id)
        k = self._loads[task_id]
        self._loads[task_id] += 1
        rng = random.Random(f"{self.lt.latency_seed}:{task_id}:{k}")
        inner = task.call_tool

        async def call_tool(ctx: Any, name: str, arguments: dict[str, Any]) -> Any:
            delay = self.draw(rng)
            if self.lt.latency_log:
                with open(self.lt.latency_log, "a") as fh:
                    fh.write(json.dumps({"task": task_id, "delay": delay, "t": time.time()}) + "\n")
            await asyncio.sleep(delay)
            return await inner(ctx, name, arguments)

        task.call_tool = call_tool
        return task


def make_longtail_drills(options: LongTailOptions) -> LongTailDrills:
    return LongTailDrills(options)


make_longtail_drills.options_model = LongTailOptions  # type: ignore[attr-defined]
ENV_NAME = "bench.async_vs_sync:make_longtail_drills"


# ====================================================================================== runs
def run_overrides(args: argparse.Namespace, ckpt: Path, mode: str, seed: int, latency_log: Path,
                  on_update: str = "retract") -> list[str]:
    env = "environment.options"
    return [f"environment.name={ENV_NAME}", f"{env}.latency={args.latency}",
            f"{env}.latency_median_s={args.median}", f"{env}.latency_sigma={args.sigma}",
            f"{env}.pareto_alpha={args.pareto_alpha}", f"{env}.pareto_scale_s={args.pareto_scale}",
            f"{env}.latency_cap_s={args.cap}", f"{env}.latency_seed={seed}", f"{env}.latency_log={latency_log}",
            "sft.enabled=false", f"model.path={ckpt}", f"tokenizer.path={ckpt / 'tokenizer.json'}",
            f"rollout.mode={mode}", f"rollout.on_update={on_update}", f"seed={seed}", f"rollout.task_seed={seed}", f"run.steps={args.steps}",
            f"run.max_minutes={args.max_run_minutes}", "trainer.num_threads=1", "engines.0.options.threads=1",
            # a step's worth in flight: slow tools need more episodes waiting at once than the
            # recipe's CPU-bound drills (32); with 32 this figure measured 1.92x (session 5), with 64 2.06x
            "rollout.max_inflight=64"]


def summarize(res: dict[str, Any], mode: str, latency_log: Path) -> dict[str, Any]:
    from bench.rl_common import med

    rows = res["train"]
    times = [r["time"] for r in rows]
    walls = [t - p for t, p in zip(times, [0.0, *times[:-1]])]
    n = len(rows)
    tail = rows[2:] if n >= 4 else rows
    span = (times[-1] - times[1]) if n >= 4 else (times[-1] if n else 0.0)
    waits = sum(r.get("time/wait", 0.0) for r in tail)
    delays = [json.loads(line)["delay"] for line in latency_log.read_text().splitlines()] \
        if latency_log.is_file() else []
    delays.sort()
    last = rows[-1] if rows else {}
    return {
        "mode": mode, "rc": res["rc"], "steps": n, "wall_s": res["wall_s"], "cpu_s": res["cpu_s"],
        "steps_per_s": (len(tail) / span) if span > 0 else None,
        "samples_per_s": (sum(r.get("rollout/num_samples", 0.0) for r in tail) / span) if span > 0 else None,
        "idle": waits / span if span > 0 else None,
        "step_s": med(walls[2:] or walls), "wait": med([r.get("time/wait") for r in tail]),
        "train": med([r.get("time/train") for r in tail]), "push": med([r.get("time/push") for r in tail]),
        "episode_avg": last.get("scheduler/episode_time_avg"), "episode_max": last.get("scheduler/episode_time_max"),
        "inflight_avg": last.get("scheduler/inflight_avg"),
        "staleness": med([r.get("buffer/taken/s_old_avg") for r in rows]),
        "span": max((r.get("buffer/taken/delta_gen_max") or 0.0 for r in rows), default=None),
        "retracted": sum(r.get("engine/retracted", 0.0) for r in rows),
        "aborted": sum(r.get("engine/aborted", 0.0) for r in rows),
        "holds": last.get("scheduler/admission_holds"),
        "tool_use": med([r.get("rollout/tool_use_rate") for r in rows]),
        "reward": med([r.get("reward/mean") for r in rows]),
        "failed": res.get("failed_trajectories"), "dropped_groups": res.get("dropped_groups"),
        "tool_calls": len(delays), "delay_mean": sum(delays) / len(delays) if delays else None,
        "delay_p50": delays[len(delays) // 2] if delays else None,
        "delay_p99": delays[min(len(delays) - 1, int(len(delays) * 0.99))] if delays else None,
        "delay_max": delays[-1] if delays else None,
    }


def report(runs: list[dict[str, Any]], args: argparse.Namespace, ckpt_info: dict[str, Any]) -> str:
    from bench.rl_common import med, med_range, table

    dist = (f"lognormal(median {args.median} s, sigma {args.sigma})" if args.latency == "lognormal" else
            f"pareto(alpha {args.pareto_alpha}, scale {args.pareto_scale} s)" if args.latency == "pareto" else "none")
    lines = [f"## fully_async vs sync on a long-tail episode mix (tool latency {dist}, cap {args.cap} s)", "",
             f"tiny-terminal recipe (echo + calc, 8x8 samples/step, 64 in flight, trainer subprocess, max staleness 2, "
             f"1 torch thread/process); SFT warm start {ckpt_info['sft_steps']} steps, shared; "
             f"{args.steps} RL steps per run (cap {args.max_run_minutes} min); seeds {args.seeds}", ""]
    head = ["mode", "seed", "steps", "steps/s", "samples/s", "idle frac", "s/step", "wait", "train", "push",
            "episode avg/max s", "staleness", "version span max", "retracted / aborted", "failed traj", "dropped groups", "tool use", "reward", "tool calls", "delay mean/p99/max s",
            "wall s"]
    body = [[r["mode"], r["seed"], r["steps"], _f(r["steps_per_s"], 3), r["samples_per_s"], r["idle"], r["step_s"],
             r["wait"], r["train"], r["push"], f"{_f(r['episode_avg'])}/{_f(r['episode_max'])}", r["staleness"],
             r["span"], f"{r['retracted']:.0f} / {r['aborted']:.0f}", r["failed"], r["dropped_groups"], r["tool_use"], r["reward"], r["tool_calls"],
             f"{_f(r['delay_mean'])}/{_f(r['delay_p99'])}/{_f(r['delay_max'])}", r["wall_s"]] for r in runs]
    lines += [table(head, body), ""]
    lines.append("steps/s, samples/s and idle frac over steps 3..N (idle = sum of time/wait / wall time). "
                 "wait/train/push: trainer-side seconds per step (medians). staleness: buffer/taken/s_old_avg. "
                 "failed traj / dropped groups: trajectories the buffer counted as failed and groups it dropped "
                 "(whole run). tool calls / delays: every injected tool latency of the run.")
    if args.keepalive_workaround:
        lines.append("Run with --keepalive-workaround (session server keep-alive raised to 60 s, bench-only).")
    lines.append("")
    s = [r for r in runs if r["mode"] == "sync"]
    for variant in dict.fromkeys(r["mode"] for r in runs if r["mode"] != "sync"):
        a = [r for r in runs if r["mode"] == variant]
        rows2 = []
        for key, label in (("steps_per_s", "steps/s"), ("samples_per_s", "samples/s"),
                           ("idle", "trainer idle fraction"), ("step_s", "s/step"), ("wait", "wait s/step"),
                           ("train", "train s/step"), ("staleness", "staleness (avg S_old)"),
                           ("cpu_s", "CPU s per run (whole)")):
            ma, ms = med([r[key] for r in a]), med([r[key] for r in s])
            rows2.append([label, med_range([r[key] for r in a], "{:.3f}"), med_range([r[key] for r in s], "{:.3f}"),
                          f"{ma / ms:.2f}x" if ma is not None and ms else "–"])
        paired = [x["steps_per_s"] / y["steps_per_s"] for x, y in zip(a, s) if x["steps_per_s"] and y["steps_per_s"]]
        rows2.append(["paired steps/s ratio (same seed)", "", "", med_range(paired, "{:.2f}x") if paired else "–"])
        lines += [table(["metric", f"{variant} median [range]", "sync median [range]", f"ratio {variant}/sync"], rows2),
                  ""]
    return "\n".join(lines)


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.rl_common import checkpoint_in_subprocess, finish, load_info, run_miles

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny SFT, 1 seed, 4 steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 12; quick 4)")
    p.add_argument("--max-run-minutes", type=float, default=2.0)
    p.add_argument("--latency", choices=["lognormal", "pareto", "none"], default="lognormal")
    p.add_argument("--median", type=float, default=0.3)
    p.add_argument("--sigma", type=float, default=1.5)
    p.add_argument("--pareto-alpha", type=float, default=1.3)
    p.add_argument("--pareto-scale", type=float, default=0.1)
    p.add_argument("--cap", type=float, default=15.0)
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default 150; quick 32)")
    p.add_argument("--checkpoint", type=Path, default=None, help="reuse a checkpoint dir from a previous run")
    p.add_argument("--out", type=Path, default=None, help="work dir (default /tmp/miles-bench/async-vs-sync-<time>)")
    p.add_argument("--on-update", nargs="+", default=["retract"], choices=["retract", "in_place", "abort", "wait"],
                   help="rollout.on_update of the fully_async runs (each one a variant against sync)")
    p.add_argument("--keepalive-workaround", action="store_true",
                   help="raise the session server's HTTP keep-alive to 60 s (bench-only patch; see rl_common.py)")
    args = p.parse_args()
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.steps = args.steps or (4 if args.quick else 12)
    sft_steps = args.sft_steps or (32 if args.quick else 150)
    out = args.out or Path("/tmp/miles-bench") / f"async-vs-sync-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"work dir {out}; {load_info()}", flush=True)
    if args.checkpoint:
        ckpt_info = json.loads((args.checkpoint / "checkpoint.json").read_text())
    else:
        print(f"SFT warm start ({sft_steps} steps) ...", flush=True)
        demos = sft_steps * 32
        ckpt_info = checkpoint_in_subprocess(out / "sft", [f"sft.demos={demos}", "sft.epochs=1",
                                                           f"trainer.sft.lr_schedule.total_steps={sft_steps}",
                                                           f"trainer.sft.lr_schedule.warmup_steps={min(20, sft_steps // 4)}"],
                                             timeout=900)
        print(f"  {ckpt_info['sft_steps']} steps in {ckpt_info['sft_s']:.0f} s", flush=True)
    ckpt = Path(ckpt_info["dir"])
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        variants = [("fully_async" if u == "retract" else f"fully_async/{u}", "fully_async", u)
                    for u in args.on_update] + [("sync", "sync", "retract")]
        for label, mode, on_update in variants:
            name = f"{label.replace('/', '-')}-s{seed}"
            log = out / f"{name}.delays.jsonl"
            log.unlink(missing_ok=True)
            print(f"{name} ... ({load_info()})", flush=True)
            res = run_miles(run_overrides(args, ckpt, mode, seed, log, on_update), out_dir=out, name=name,
                            timeout=args.max_run_minutes * 60 + 180, keepalive_workaround=args.keepalive_workaround)
            if res.get("error"):
                print(res["error"], file=sys.stderr)
            r = summarize(res, label, log)
            r.update(seed=seed, load=os.getloadavg()[0])
            runs.append(r)
            print(f"  {r['steps']} steps, {r['steps_per_s'] or 0:.3f} steps/s, idle {r['idle'] or 0:.2f}, "
                  f"failed trajectories {r['failed']:.0f}, wall {r['wall_s']:.0f} s", flush=True)
    text = report(runs, args, ckpt_info)
    finish(out, text, runs, ckpt_info, args, t0)


if __name__ == "__main__":
    main()
