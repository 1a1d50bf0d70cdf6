"""RL trainer step benchmark: fused old log-probs and shared-prefix forward (prints a table; not a test).

    .venv/bin/python bench/trainer_step_bench.py [--reps 9] [--prompt-len 0] [--ckpt DIR]
    .venv/bin/python bench/trainer_step_bench.py --true-on-policy [--reps 9]   # the mode's cost only

One GRPO ``TorchTrainer.train_step`` on 8 groups x 8 rows, 1 torch thread, the trainer settings
of ``recipes/tiny-terminal.yaml`` (AdamW lr 1e-3, clip 0.2, TIS, grad clip 1). The policy is the
SFT checkpoint of the RL benches (``/tmp/miles-bench/rvt-s2/sft/checkpoint``) when present, else
a random Qwen3 of the recipe's ``model:`` shape (vocab 2048). Prompts: the ``shell-drills`` echo
prompts rendered by the stack (``make_codec`` + the checkpoint's tokenizer, as
``bench/rl_vs_trl.py`` feeds TRL), or ``--prompt-len N`` random tokens (also without a
checkpoint). Each row: its group's prompt + 5..40 sampled tokens; rollout log-probs are the
policy's own. Variants (one trainer each, same weights, steps interleaved):

- ``baseline``: separate no-grad old-log-prob pass, plain forward
- ``fused``: old log-probs from the update's forward (``algorithm.fuse_old_logprobs``)
- ``fused+prefix``: and the shared-prefix forward (``shared_prefix``)

The first step of each variant starts from identical weights; after the table come the differences
of that step's loss, TIS ratio and gradients (float noise only) and of the parameters after it.

``--true-on-policy`` (instead of the variants table): the cost of ``trainer.true_on_policy``
(batch-invariant forward). ``baseline`` and ``fused+prefix``, each with the mode off and on (four
trainers, same weights, steps interleaved): wall and CPU time per step, median and range, tokens
per CPU second (the batch's row lengths summed), on/off ratio of CPU time.

``--megatron``: a second table, the same 64-row batch on the Megatron backend (``trainer.backend:
megatron``, rank subprocesses over gloo, fused old log-probs, no shared-prefix forward) at TP=1
(one rank) and TP=2 (two ranks), against the torch backend in this process (``fused``); step
times are wall times seen by the driver (including the pipe to the ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer.torch_trainer import TorchTrainer
from miles_engine.hub import default_hub

CKPT = Path("/tmp/miles-bench/rvt-s2/sft/checkpoint")
RECIPE_MODEL = {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 384,
                "max_position_embeddings": 512, "tie_word_embeddings": True, "pad_token_id": 0}
TRAINER = {"optimizer": {"lr": 1e-3}, "clip": {"eps_low": 0.2}, "mismatch": {"mode": "tis"}, "grad_clip": 1.0,
           "num_threads": 1}
VARIANTS = {"baseline": (False, False), "fused": (True, False), "fused+prefix": (True, True)}
GROUPS, SIZE = 8, 8


def echo_prompts(ckpt: Path, n: int) -> list[list[int]]:
    """The first ``n`` echo-drill prompts as our TITO server renders them (token ids)."""
    from miles_engine.config.recipe import load_recipe
    from miles_engine.hub import Hub
    from miles_engine.tito import make_codec
    from miles_engine.tito.messages import normalize_messages, normalize_tools
    from miles_engine.models.tokenizer import load_tokenizer

    cfg = load_recipe("tiny-terminal", ["environment.options.kinds=[echo]"], hub=default_hub())
    hub = Hub()
    source = hub.create("environment", cfg.environment.name, cfg.environment.options)
    codec = make_codec(cfg.chat_family.name, load_tokenizer(str(ckpt / "tokenizer.json")),
                       options=cfg.chat_family.options, hub=hub)
    out = []
    for i in range(n):
        task = source.load_task(source.task_id(i))
        tools = normalize_tools([t.openai_schema() for t in task.tools()])
        out.append(codec.encode_conversation(normalize_messages(task.prompt()), tools, add_generation_prompt=True))
    return out


def random_prompts(n: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def build_groups(probe: TorchTrainer, prompts: list[list[int]], gen: torch.Generator) -> list[Group]:
    """``SIZE`` rows per prompt: prompt + 5..40 random sampled tokens, rewards 0/1 varying inside
    each group, rollout log-probs = the policy's (as a fresh on-policy rollout would report)."""
    rows: list[tuple[list[int], list[int]]] = []
    for p in prompts:
        for _ in range(SIZE):
            n = int(torch.randint(5, 41, (1,), generator=gen))
            rows.append((p + torch.randint(3, probe.vocab_size, (n,), generator=gen).tolist(),
                         [0] * len(p) + [1] * n))
    logps = probe.compute_logprobs(rows)
    groups = []
    for g, p in enumerate(prompts):
        trajs = []
        for j in range(SIZE):
            ids, mask = rows[g * SIZE + j]
            lp = [x if m else 0.0 for x, m in zip(logps[g * SIZE + j], mask)]
            trajs.append(Trajectory(ids, mask, lp, [0 if m else None for m in mask], reward=float((g + j) % 2),
                                    index=j))
        groups.append(Group(f"g{g}", f"t{g}", trajs, 0))
    return groups


def trainer(source: Any, fused: bool, shared: bool) -> TorchTrainer:
    return TorchTrainer(source, {**TRAINER, "algorithm": {"fuse_old_logprobs": fused}, "shared_prefix": shared})


def max_param_diff(a: TorchTrainer, b: TorchTrainer) -> float:
    pa, pb = dict(a.named_tensors()), dict(b.named_tensors())
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)


def step_with_grads(tr: TorchTrainer, groups: list[Group]) -> tuple[dict[str, float], list[torch.Tensor]]:
    """``train_step`` and the gradients its optimizer step saw."""
    grads: list[torch.Tensor] = []
    original = tr.optimizer_step

    def spy(opt: Any, sched: Any, ps: list[Any]) -> dict[str, float]:
        grads.extend(p.grad.clone() for p in ps)
        return original(opt, sched, ps)

    tr.optimizer_step = spy  # type: ignore[method-assign]
    try:
        return tr.train_step(groups), grads
    finally:
        tr.optimizer_step = original  # type: ignore[method-assign]


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / x.abs().max().clamp(min=1e-12)).item() for x, y in zip(a, b))


def fmt_row(name: str, times: dict[str, list[float]], base: float) -> str:
    step, prep, upd = (statistics.median(times[k]) for k in ("step_time", "prepare_time", "update_time"))
    lo, hi = min(times["step_time"]), max(times["step_time"])
    return (f"| {name:<13} | {step * 1e3:7.1f} | {lo * 1e3:6.1f}-{hi * 1e3:<6.1f} | {prep * 1e3:7.1f} | "
            f"{upd * 1e3:7.1f} | {base / step:5.2f}x |")


def megatron_table(source: Any, groups: list[Group], reps: int) -> None:
    from miles_engine.trainer.factory import create_trainer

    cfg = {**TRAINER, "algorithm": {"fuse_old_logprobs": True}, "shared_prefix": False}
    backends: dict[str, Any] = {"torch (fused)": TorchTrainer(source, cfg)}
    for tp in (1, 2):
        t0 = time.perf_counter()
        backends[f"megatron TP={tp}"] = create_trainer(source, {**cfg, "backend": "megatron",
                                                                "megatron": {"tensor_parallel": tp}}, world_size=tp)
        print(f"megatron TP={tp}: ranks started in {time.perf_counter() - t0:.1f} s")
    try:
        losses = {name: tr.train_step(groups)["loss"] for name, tr in backends.items()}  # warm-up, same weights
        times: dict[str, list[float]] = {n: [] for n in backends}
        for _ in range(reps):
            for name, tr in backends.items():
                t0 = time.perf_counter()
                tr.train_step(groups)
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["torch (fused)"])
        print(f"\ntrain_step by backend, {reps} reps each, interleaved (ms, wall at the driver)\n")
        print("| backend        | step ms | range         | vs torch | first-step loss |")
        print("|----------------|---------|---------------|----------|-----------------|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name:<14} | {med * 1e3:7.1f} | {min(ts) * 1e3:6.1f}-{max(ts) * 1e3:<6.1f} | "
                  f"{base / med:7.2f}x | {losses[name]:15.6f} |")
    finally:
        for tr in backends.values():
            tr.close()


def true_on_policy_table(source: Any, groups: list[Group], reps: int) -> None:
    tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
    trainers = {(name, mode): TorchTrainer(source, {**TRAINER, "true_on_policy": mode == "on",
                                                    "algorithm": {"fuse_old_logprobs": VARIANTS[name][0]},
                                                    "shared_prefix": VARIANTS[name][1]})
                for name in ("baseline", "fused+prefix") for mode in ("off", "on")}
    for tr in trainers.values():
        tr.train_step(groups)  # warm-up
    wall: dict[tuple[str, str], list[float]] = {k: [] for k in trainers}
    cpu: dict[tuple[str, str], list[float]] = {k: [] for k in trainers}
    for _ in range(reps):  # interleaved
        for key, tr in trainers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            tr.train_step(groups)
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    print(f"\ntrain_step with trainer.true_on_policy off vs on, {reps} reps each, interleaved ({tokens} tokens "
          f"per step; median [range]; CPU = this process's CPU time, the cost on a shared box)\n")
    print("| variant      | mode | wall ms                  | CPU ms                   | tokens/CPU-s | on/off CPU |")
    print("|--------------|------|--------------------------|--------------------------|--------------|------------|")
    for (name, mode), ts in wall.items():
        cs = cpu[(name, mode)]
        ratio = statistics.median(cs) / statistics.median(cpu[(name, "off")])
        print(f"| {name:<12} | {mode:<4} | {spread_ms(ts):<24} | {spread_ms(cs):<24} | "
              f"{tokens / statistics.median(cs):12.0f} | {ratio:9.2f}x |")


def spread_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} [{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="timed steps per variant (after 1 warm-up)")
    ap.add_argument("--prompt-len", type=int, default=0, help="random prompts of N tokens instead of echo drills")
    ap.add_argument("--ckpt", type=Path, default=CKPT, help="HF model dir + tokenizer.json (else a random model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--true-on-policy", action="store_true", help="only the table of trainer.true_on_policy off vs on")
    ap.add_argument("--megatron", action="store_true", help="also: torch vs the Megatron backend at TP=1 and TP=2")
    ap.add_argument("--only-megatron", action="store_true", help="only the backend table")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the first model load imports transformers
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    have_ckpt = (args.ckpt / "config.json").exists() and (args.ckpt / "tokenizer.json").exists()
    source: Any = str(args.ckpt) if have_ckpt else RECIPE_MODEL
    trainers = {name: trainer(source, *flags) for name, flags in VARIANTS.items()}
    probe = trainers["baseline"]
    if args.prompt_len or not have_ckpt:
        prompts = random_prompts(GROUPS, args.prompt_len or 150, probe.vocab_size, gen)
        what = f"random prompts of {len(prompts[0])} tokens"
    else:
        prompts = echo_prompts(args.ckpt, GROUPS)
        what = f"echo-drill prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    groups = build_groups(probe, prompts, gen)
    rows = [t for g in groups for t in g.trajectories]
    lengths = [len(t.token_ids) for t in rows]
    print(f"model: {'checkpoint ' + str(args.ckpt) if have_ckpt else 'random recipe-shape Qwen3'}; {what}; "
          f"{len(rows)} rows of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} tokens, "
          f"{sum(sum(t.loss_mask) for t in rows)} sampled); torch threads {torch.get_num_threads()}")

    if args.true_on_policy:
        true_on_policy_table(source, groups, args.reps)
        return
    if args.only_megatron:
        megatron_table(source, groups, args.reps)
        return
    first = {name: step_with_grads(tr, groups) for name, tr in trainers.items()}  # warm-up, identical weights
    drift = {name: max_param_diff(tr, probe) for name, tr in trainers.items()}
    times: dict[str, dict[str, list[float]]] = {n: {} for n in VARIANTS}
    for _ in range(args.reps):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            m = tr.train_step(groups)
            m["step_time"] = time.perf_counter() - t0
            for k in ("step_time", "prepare_time", "update_time"):
                times[name].setdefault(k, []).append(m[k])

    base = statistics.median(times["baseline"]["step_time"])
    print(f"\ntrain_step, {args.reps} reps each, interleaved (ms; median, range of the step)\n")
    print("| variant       | step ms | range         | prepare | update  | speed-up |")
    print("|---------------|---------|---------------|---------|---------|----------|")
    for name in VARIANTS:
        print(fmt_row(name, times[name], base))
    print("\nfirst step from identical weights, vs baseline: |loss diff|, |tis/ratio_mean diff|, max gradient "
          "diff / max |gradient| (per tensor), max |param diff| after AdamW (eps 1e-8: ~lr * sign(g) where g ~ 0)")
    m0, g0 = first["baseline"]
    for name in ("fused", "fused+prefix"):
        m, g = first[name]
        print(f"  {name:<13} loss {abs(m['loss'] - m0['loss']):.1e}  "
              f"tis {abs(m['tis/ratio_mean'] - m0['tis/ratio_mean']):.1e}  grad {max_rel_diff(g0, g):.1e}  "
              f"params {drift[name]:.1e}")
    if args.megatron:
        megatron_table(source, groups, args.reps)


if __name__ == "__main__":
    main()
