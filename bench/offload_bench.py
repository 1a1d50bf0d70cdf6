"""trainer.offload figures (prints a table; not a test).

    .venv/bin/python bench/offload_bench.py [--reps 3] [--models smollm2,100m]

Two torch trainers per model, same seed: ``offload: none`` and ``offload: disk`` (file in
``--dir``, default $TMPDIR). Each repeat, interleaved: one GRPO ``train_step`` on 2 groups x 4
rows of 64 tokens (AdamW, so its two moments exist), then for the ``disk`` trainer the offload
(bytes per state kind, seconds, the process's RSS before and after) and the reload that the next
step starts with. Models (random init; offload moves bytes, their values do not matter):

- ``smollm2``: SmolLM2-135M-Instruct's shape (Llama, 30 layers, hidden 576, vocab 49152, tied)
- ``100m``: a ~100M-parameter Qwen3 (12 layers, hidden 768, vocab 8192)

Step time of the ``disk`` trainer includes its reload; the ratio to ``none`` is the step-time
cost of offloading between steps. Medians [ranges] over the repeats.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer.torch_trainer import TorchTrainer

MODELS = {
    "smollm2": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "max_position_embeddings": 2048, "tie_word_embeddings": True, "pad_token_id": 0},
    "100m": {"model_type": "qwen3", "vocab_size": 8192, "hidden_size": 768, "intermediate_size": 2304,
             "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
             "max_position_embeddings": 2048, "tie_word_embeddings": True, "pad_token_id": 0},
}
TRAINER = {"optimizer": {"lr": 1e-5}, "mismatch": {"mode": "tis"}, "num_threads": 2}


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def groups(vocab: int) -> list[Group]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(2):
        prompt = torch.randint(1, vocab, (32,), generator=g).tolist()
        rows = []
        for j in range(4):
            ids = prompt + torch.randint(1, vocab, (32,), generator=g).tolist()
            mask = [0] * 32 + [1] * 32
            rows.append(Trajectory(token_ids=ids, loss_mask=mask, rollout_logprobs=[-5.0 * m for m in mask],
                                   weight_versions=[0 if m else None for m in mask], reward=float(j % 2), index=j))
        out.append(Group(group_id=f"g{i}", task_id=f"t{i}", trajectories=rows, submitted_version=0))
    return out


def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    v = [x / scale for x in values]
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}-{max(v):.{digits}f}]"


def bench(name: str, reps: int, directory: str) -> None:
    config = MODELS[name]
    plain = TorchTrainer(config, TRAINER)
    off = TorchTrainer(config, {**TRAINER, "offload": "disk", "offload_dir": directory})
    batch = groups(config["vocab_size"])
    step = {"none": [], "disk": []}
    offload_s, reload_s, freed, before_rss, after_rss = [], [], [], [], []
    figures: dict[str, float] = {}
    for _ in range(reps + 1):  # the first step of each (optimizer state created) is not counted
        for label, trainer in (("none", plain), ("disk", off)):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            step[label].append(time.perf_counter() - t0)
        reload_s.append(off.offloader.report.reload_s)
        gc.collect()
        before = rss()
        figures = off.offload()
        after = rss()
        offload_s.append(figures["offload_time"])
        before_rss.append(before)
        after_rss.append(after)
        freed.append(before - after)
    step = {k: v[1:] for k, v in step.items()}
    offload_s, reload_s, freed = offload_s[1:], reload_s[1:], freed[1:]  # reload_s[0]: nothing was offloaded
    gib = 1 << 30
    n_params = sum(p.numel() for p in off.policy.parameters())
    print(f"\n### {name}: {n_params / 1e6:.0f}M parameters, float32\n")
    print("| state kind | bytes offloaded, GiB |\n|---|---|")
    for kind in ("weights", "grads", "optimizer"):
        print(f"| {kind} | {figures[f'offload_bytes_{kind}'] / gib:.3f} |")
    total = sum(figures[f"offload_bytes_{k}"] for k in ("weights", "grads", "optimizer"))
    print(f"\n| figure | median [range] |\n|---|---|")
    print(f"| offload to disk, s | {fmt(offload_s)} |")
    print(f"| reload from disk (next step's start), s | {fmt(reload_s)} |")
    print(f"| RSS before offload, GiB | {fmt(before_rss[1:], gib)} |")
    print(f"| RSS after offload, GiB | {fmt(after_rss[1:], gib)} |")
    print(f"| RSS freed / bytes offloaded | {fmt([f / total for f in freed])} |")
    print(f"| step, offload none, s | {fmt(step['none'])} |")
    print(f"| step incl. reload, offload disk, s | {fmt(step['disk'])} |")
    print(f"| step-time ratio disk / none | {statistics.median(step['disk']) / statistics.median(step['none']):.2f}x |")
    plain.close()
    off.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--models", default="smollm2,100m")
    p.add_argument("--dir", default=None, help="where the offload file goes (default: a temporary directory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as tmp:
        for name in args.models.split(","):
            bench(name, args.reps, args.dir or tmp)


if __name__ == "__main__":
    main()
