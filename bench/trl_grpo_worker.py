"""One TRL GRPOTrainer run of ``bench/rl_vs_trl.py`` (figure 1 of issue 5), in this process.

    python bench/trl_grpo_worker.py --ckpt SFT_DIR --seed 0 --steps 30 --out RUN.json [--model smollm2]

Started by ``rl_vs_trl.py`` once per seed; the matched settings (model, prompts, GRPO knobs, LoRA,
the reward's sandbox-like environment) are described there. Writes a JSON summary to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rl_vs_trl import SETUPS  # noqa: E402
from miles_engine.hub import default_hub  # noqa: E402


def trl_worker(args: argparse.Namespace) -> None:
    """One TRL GRPOTrainer run in this process; writes a JSON summary to ``args.out``."""
    t_proc = time.perf_counter()
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import torch

    torch.set_num_threads(1)
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles_engine.config.recipe import load_recipe
    from miles_engine.hub import Hub
    from miles_engine.tito import make_codec
    from miles_engine.tito.messages import normalize_messages, normalize_tools
    from miles_engine.tito.parsers import parse_hermes_tool_calls
    from miles_engine.models.tokenizer import load_tokenizer

    ckpt = Path(args.ckpt)
    setup = SETUPS[args.model]
    cfg = load_recipe(setup.recipe, list(setup.echo), hub=default_hub())
    hub = Hub()
    source = hub.create("environment", cfg.environment.name, cfg.environment.options)
    codec = make_codec(cfg.chat_family.name, load_tokenizer(str(ckpt / "tokenizer.json")),
                       options=cfg.chat_family.options, hub=hub)
    if setup.model == "tiny":
        tok = PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"), eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
    else:  # the model's own tokenizer as exported with it (SmolLM2: eos <|im_end|>, pad <|im_end|>)
        tok = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
        if tok.pad_token is None:
            tok.pad_token = "<|endoftext|>"
    peft_config = None
    if cfg.trainer.lora.enabled:  # the recipe's own adapters, the same shape as our trainer's
        from peft import LoraConfig

        lo = cfg.trainer.lora
        peft_config = LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                                 target_modules=lo.target_modules, bias="none", task_type="CAUSAL_LM")
    stop_texts = list(codec.family.stop_tokens)

    rows = []
    for i in range(args.num_prompts):
        task = source.load_task(source.task_id(i))
        tools = normalize_tools([t.openai_schema() for t in task.tools()])
        prompt = normalize_messages(task.prompt())
        text = codec.render(prompt, tools, add_generation_prompt=True)
        if i < 16:  # the prompt TRL feeds is token for token the prompt our server feeds
            ours = codec.encode_conversation(prompt, tools, add_generation_prompt=True)
            if tok(text=[text])["input_ids"][0] != ours:
                raise SystemExit(f"prompt ids differ between TRL's tokenizer and our codec for {task.id}")
        rows.append({"prompt": text, "word": task.instance.params["word"]})
    dataset = Dataset.from_list(rows)

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model.generation_config.eos_token_id = list(codec.stop_ids)  # <|im_end|>, <|endoftext|> as our engine
    model.generation_config.pad_token_id = tok.pad_token_id

    timers: dict[str, float] = {}
    orig_log = profiling.ProfilingContext._log_metrics

    def record(self: Any, duration: float) -> None:
        timers[self.name] = timers.get(self.name, 0.0) + duration
        return orig_log(self, duration)

    profiling.ProfilingContext._log_metrics = record  # type: ignore[method-assign]

    pool = ThreadPoolExecutor(8)
    reward_time = [0.0]
    tool_use: list[float] = []

    def first_bash(ids: list[int]) -> str | None:
        text = codec.tokenizer.decode(ids)
        for stop in stop_texts:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        found = parse_hermes_tool_calls(text)
        if found is None:
            return None
        for call in found[1]:
            if call.name == "bash":
                command = call.arguments.get("command")
                return command if isinstance(command, str) and command.strip() else ""
        return None

    from miles_engine.sandbox.local.env import build_env
    from miles_engine.sandbox.local.scratch import resolve_root

    work_root = resolve_root("tmpfs")[0]  # where our recipe's sandboxes keep their files (fair footing)

    def run_bash(command: str | None) -> str | None:
        if not command:
            return None
        with tempfile.TemporaryDirectory(prefix="trl-echo-", dir=work_root) as tmp:
            # the environment our sandbox gives a command: the same PATH resolves `python3` to the
            # same binary (this box's login PATH starts with pyenv shims, ~6x the CPU per call)
            env = build_env(sandbox_id="trl-reward", home=tmp, user="root", tmpdir=tmp)
            try:
                return subprocess.run(["bash", "-c", command], cwd=tmp, capture_output=True, text=True,
                                      timeout=10, stdin=subprocess.DEVNULL, env=env).stdout
            except (subprocess.TimeoutExpired, OSError, UnicodeDecodeError):
                return None

    def echo_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    word: list[str], **_: Any) -> list[float]:
        t0 = time.perf_counter()
        commands = [first_bash(ids) for ids in completion_ids]
        tool_use.append(sum(c is not None for c in commands) / max(len(commands), 1))
        outs = list(pool.map(run_bash, commands))
        reward_time[0] += time.perf_counter() - t0
        return [1.0 if o is not None and o.strip() == w else 0.0 for o, w in zip(outs, word)]

    steps: list[dict[str, Any]] = []
    state: dict[str, Any] = {}

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, a: Any, s: Any, c: Any, **kw: Any) -> None:
            state["t0"] = state["last"] = time.perf_counter()
            timers.clear()
            reward_time[0] = 0.0

        def on_step_end(self, a: Any, s: Any, c: Any, **kw: Any) -> None:
            now = time.perf_counter()
            gen = sum(v for k, v in timers.items() if k.endswith("transformers.generate"))
            rew = reward_time[0]
            steps.append({"step": s.global_step, "time": now - state["t0"], "wall": now - state["last"],
                          "generation": gen, "reward": rew, "other": now - state["last"] - gen - rew,
                          "timers": dict(timers), "tool_use": tool_use[-1] if tool_use else None})
            state["last"] = now
            timers.clear()
            reward_time[0] = 0.0
            if args.max_seconds and now - state["t0"] > args.max_seconds:
                c.should_training_stop = True

        def on_log(self, a: Any, s: Any, c: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                for row in steps[::-1]:
                    if row["step"] == s.global_step:
                        row.update(reward_mean=logs["reward"], completion_len=logs.get("completions/mean_length"),
                                   trl_step_time=logs.get("step_time"))
                        break

    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trl")), per_device_train_batch_size=setup.group * setup.prompts,
        gradient_accumulation_steps=1, num_generations=setup.group, max_completion_length=setup.max_tokens,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=setup.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", num_iterations=1, max_steps=args.steps, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
        gradient_checkpointing=False,  # TRL defaults it on (memory); ours does not checkpoint either, and it is slower
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[echo_reward], args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[Timing()], peft_config=peft_config)
    t_start = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    pool.shutdown()
    Path(args.out).write_text(json.dumps({"steps": steps, "startup_s": t_start - t_proc,
                                          "train_s": t_end - t_start, "trl": __import__("trl").__version__}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="SFT checkpoint dir (HF model + tokenizer.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True, help="where the JSON summary goes")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this much training time")
    p.add_argument("--num-prompts", type=int, default=4096)
    p.add_argument("--model", choices=sorted(SETUPS), default="tiny", help="which setup of rl_vs_trl.py")
    trl_worker(p.parse_args())


if __name__ == "__main__":
    main()
