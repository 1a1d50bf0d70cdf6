"""trainer.offload figures (prints a table; not a test).

    .venv/bin/python bench/offload_bench.py [--reps 3] [--models smollm2,100m]

Four torch trainers per model, same seed: ``offload: none``, ``offload: disk`` (file in ``--dir``,
default $TMPDIR), ``optimizer_state: disk`` (Adam's moments streamed from a file through each
update) and both. Each repeat, interleaved: one GRPO ``train_step`` on 2 groups x 4 rows of 64
tokens (AdamW, so its two moments exist), then for the offloading trainers the offload (bytes per
state kind, seconds, the process's RSS before and after) and the reload that the next step starts
with. Models (random init; offload moves bytes, their values do not matter):

- ``smollm2``: SmolLM2-135M-Instruct's shape (Llama, 30 layers, hidden 576, vocab 49152, tied)
- ``100m``: a ~100M-parameter Qwen3 (12 layers, hidden 768, vocab 8192)

Step time of an offloading trainer includes its reload; the ratio to ``none`` is the step-time
cost of offloading between steps, or of streaming the optimizer state. With the state streamed,
an offload has no optimizer state left to move (it is on disk already). Medians [ranges].
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
    stream = {"optimizer_state": "disk", "optimizer_state_dir": directory}
    trainers = {"none": TorchTrainer(config, TRAINER),
                "disk": TorchTrainer(config, {**TRAINER, "offload": "disk", "offload_dir": directory}),
                "stream": TorchTrainer(config, {**TRAINER, **stream}),
                "disk+stream": TorchTrainer(config, {**TRAINER, **stream, "offload": "disk", "offload_dir": directory})}
    batch = groups(config["vocab_size"])
    step: dict[str, list[float]] = {k: [] for k in trainers}
    offload_s, reload_s, freed, after_rss, figures = ({k: [] for k in ("disk", "disk+stream")} for _ in range(5))
    stream_s: list[float] = []
    for i in range(reps + 1):  # the first step of each (optimizer state created) is not counted
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for label in order:
            trainer = trainers[label]
            t0 = time.perf_counter()
            metrics = trainer.train_step(batch)
            step[label].append(time.perf_counter() - t0)
            if label == "stream":
                stream_s.append(metrics["optimizer_stream_s"])
            if label in offload_s:
                reload_s[label].append(trainer.offloader.report.reload_s)
                gc.collect()
                before = rss()
                figures[label].append(trainer.offload())
                after = rss()
                offload_s[label].append(figures[label][-1]["offload_time"])
                after_rss[label].append(after)
                freed[label].append(before - after)
    step = {k: v[1:] for k, v in step.items()}
    gib = 1 << 30
    n_params = sum(p.numel() for p in trainers["none"].policy.parameters())
    streamed = trainers["stream"].streams[id(trainers["stream"].optimizer)]
    print(f"\n### {name}: {n_params / 1e6:.0f}M parameters, float32\n")
    print("| state kind | bytes offloaded, GiB: offload disk | offload disk + optimizer_state disk |\n|---|---|---|")
    for kind in ("weights", "grads", "optimizer"):
        print(f"| {kind} | {figures['disk'][-1][f'offload_bytes_{kind}'] / gib:.3f} | "
              f"{figures['disk+stream'][-1][f'offload_bytes_{kind}'] / gib:.3f} |")
    print("\n| figure | offload disk | offload disk + optimizer_state disk |\n|---|---|---|")
    row = lambda title, d, scale=1.0: print(f"| {title} | {fmt(d['disk'][1:], scale)} | "  # noqa: E731
                                            f"{fmt(d['disk+stream'][1:], scale)} |")
    row("offload, s", offload_s)
    row("reload (the next step's start), s", reload_s)
    row("RSS after offload, GiB", after_rss, gib)
    row("RSS freed by the offload, GiB", freed, gib)
    print("\n| step (median [range]), s | |\n|---|---|")
    for label in trainers:
        ratio = statistics.median(step[label]) / statistics.median(step["none"])
        print(f"| {label} | {fmt(step[label])} ({ratio:.2f}x) |")
    print(f"\noptimizer_state disk: {fmt(stream_s[1:])} s of each step read and wrote the state file "
          f"(bucket {TorchTrainer(config, TRAINER).config.optimizer_bucket_mb:.0f} MiB); at most "
          f"{streamed.peak_resident_bytes / gib:.3f} GiB of it in memory at once, none between steps")
    for trainer in trainers.values():
        trainer.close()


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
