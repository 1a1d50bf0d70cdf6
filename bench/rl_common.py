"""Shared pieces of the RL benchmarks (``rl_vs_trl.py``, ``async_vs_sync.py``); not a test.

- :func:`build_checkpoint`: one SFT warm start through the stack's own builders (environment,
  policy tokenizer, tiny Qwen3, ``run_sft`` on a ``TorchTrainer``), saved as a Hugging Face model
  directory plus the tokenizer file, so every RL run (ours and TRL's) starts from the same weights
  and the same vocabulary (``model.path=`` / ``tokenizer.path=`` in our recipe).
- :func:`run_miles`: ``miles train RECIPE key=value ...`` in a fresh process (1 torch thread),
  returning its ``metrics.jsonl`` rows, wall time and CPU time (process tree).
- moving averages, thresholds and small table helpers.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MILES = str(Path(PYTHON).with_name("miles"))

ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ONE_THREAD_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------------- SFT checkpoint
def build_checkpoint(out: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """SFT once with the recipe ``tiny-terminal`` + ``overrides``; save model + tokenizer under ``out``.

    Uses the composition root's own builders (``build_codec`` / ``build_policy``) and ``run_sft``
    on an in-process ``TorchTrainer`` (no engine, server or sandbox needed)."""
    import asyncio

    import torch

    from miles_engine.config.recipe import load_recipe
    from miles_engine.metrics import MetricsConfig, MetricsLogger
    from miles_engine.hub import default_hub
    from miles_engine.run.policy import build_codec, build_policy
    from miles_engine.sft.warm_start import SFTInputs, run_sft
    from miles_engine.run.trainer_access import TrainerAccess
    from miles_engine.trainer.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = load_recipe("tiny-terminal", list(overrides), hub=default_hub())
    hub = default_hub()
    source = hub.create("environment", cfg.environment.name, cfg.environment.options, where="environment.options")
    codec = build_codec(cfg, hub, source)
    trainer = TorchTrainer(build_policy(cfg, codec), cfg.trainer)
    t_built = time.perf_counter()
    (out / "sft-run").mkdir(parents=True, exist_ok=True)
    metrics = MetricsLogger(out / "sft-run", MetricsConfig(progress=False, tensorboard=False), total_steps=1)
    asyncio.run(run_sft(SFTInputs(cfg=cfg, trainer=TrainerAccess(trainer), codec=codec, source=source,
                                  metrics=metrics)))
    metrics.close()
    t_sft = time.perf_counter()
    ckpt = out / "checkpoint"
    trainer.policy.save_pretrained(ckpt, safe_serialization=True)
    tok_src = Path(codec.tokenizer.name)
    if not tok_src.is_file():
        codec.tokenizer.backend.save(str(ckpt / "tokenizer.json"))
    else:
        shutil.copyfile(tok_src, ckpt / "tokenizer.json")
    rows = [json.loads(line) for line in (out / "sft-run" / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["kind"] == "sft"]
    info = {"dir": str(ckpt), "tokenizer": str(ckpt / "tokenizer.json"), "build_s": t_built - t0,
            "sft_s": t_sft - t_built, "sft_steps": len(sft), "params": sum(p.numel() for p in trainer.policy.parameters()),
            "vocab": codec.tokenizer.vocab_size,
            "loss_first": sft[0].get("sft/loss") if sft else None, "loss_last": sft[-1].get("sft/loss") if sft else None}
    trainer.close()
    (out / "checkpoint.json").write_text(json.dumps(info, indent=1))
    return info


def checkpoint_in_subprocess(out: Path, overrides: Sequence[str], timeout: float) -> dict[str, Any]:
    """:func:`build_checkpoint` in a fresh process (1 thread), so the bench driver stays light."""
    code = ("import json,sys; from pathlib import Path; sys.path.insert(0, %r); "
            "from bench.rl_common import build_checkpoint; "
            "build_checkpoint(Path(sys.argv[1]), json.loads(sys.argv[2]))" % str(ROOT))
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([PYTHON, "-c", code, str(out), json.dumps(list(overrides))], env=child_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"SFT checkpoint failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((out / "checkpoint.json").read_text())


def export_checkpoint(out: Path, recipe: str, overrides: Sequence[str], timeout: float) -> dict[str, Any]:
    """A pretrained recipe's SFT warm start as a Hugging Face directory, through the CLI a user has:
    ``miles train RECIPE run.steps=0 overrides...`` (its SFT, then the step-0 checkpoint), then
    ``miles export RUN --merged OUT/checkpoint`` (LoRA adapters merged into the base; the model
    source's own tokenizer and chat template beside them)."""
    res = run_miles(overrides, out_dir=out, name="sft-run", timeout=timeout, recipe=recipe)
    if res.get("error"):
        raise RuntimeError(f"SFT warm start failed: {res['error']}")
    ckpt = out / "checkpoint"
    shutil.rmtree(ckpt, ignore_errors=True)
    exported = run_process([MILES, "export", str(out / "sft-run"), "--merged", str(ckpt)], log=out / "export.log",
                           timeout=timeout)
    if exported["rc"] != 0:
        raise RuntimeError(f"miles export failed (rc {exported['rc']}):\n{(out / 'export.log').read_text()[-4000:]}")
    from safetensors import safe_open
    from tokenizers import Tokenizer

    params = 0
    for file in ckpt.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                params += math.prod(shape)
    cfg = yaml.safe_load((out / "sft-run" / "config.yaml").read_text())
    lora = (cfg.get("trainer") or {}).get("lora") or {}
    sft = [r for r in res["rows"] if r["kind"] == "sft"]
    info = {"dir": str(ckpt), "tokenizer": str(ckpt / "tokenizer.json"), "build_s": 0.0,
            "sft_s": res["wall_s"], "sft_steps": len(sft), "params": params,
            "vocab": Tokenizer.from_file(str(ckpt / "tokenizer.json")).get_vocab_size(),
            "loss_first": sft[0].get("sft/loss") if sft else None, "loss_last": sft[-1].get("sft/loss") if sft else None,
            "lora": (f"LoRA r{lora.get('rank')} alpha {lora.get('alpha')} on {','.join(lora.get('target_modules') or [])}"
                     if lora.get("enabled") else None), "export_s": exported["wall_s"]}
    (out / "checkpoint.json").write_text(json.dumps(info, indent=1))
    return info


# ---------------------------------------------------------------------------------- subprocess runs
def run_process(argv: Sequence[str], *, log: Path, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv``; stdout+stderr to ``log``. Returns rc, wall and CPU seconds of the process tree
    (every descendant that was waited for: trainer ranks, sandbox shells, ...)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(list(argv), stdout=fh, stderr=subprocess.STDOUT, env=env or child_env(), cwd=ROOT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"rc": rc, "wall_s": wall, "cpu_s": cpu, "log": str(log)}


# Bench-only workaround (see --keepalive-workaround): the session server (uvicorn) closes idle
# keep-alive connections after its default 5 s while the agents' pooled aiohttp client keeps them
# for 30 s, so an episode whose tool call takes > 5 s may reuse a connection the server is closing
# ("ClientOSError: [Errno 104] Connection reset by peer" -> a failed trajectory). This runs
# `miles train` with the server's keep-alive raised to 60 s; core code is not touched.
KEEPALIVE_PATCH = (
    "import sys, uvicorn\n"
    "_init = uvicorn.Config.__init__\n"
    "def _patched(self, *a, **kw):\n"
    "    kw.setdefault('timeout_keep_alive', 60)\n"
    "    _init(self, *a, **kw)\n"
    "uvicorn.Config.__init__ = _patched\n"
    "from miles_engine.cli.main import main\n"
    "main(sys.argv[1:])\n"
)


def run_miles(overrides: Sequence[str], *, out_dir: Path, name: str, timeout: float,
              recipe: str = "tiny-terminal", keepalive_workaround: bool = False) -> dict[str, Any]:
    """``miles train RECIPE overrides... run.out_dir=OUT run.name=NAME``; adds the metrics rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = [PYTHON, "-c", KEEPALIVE_PATCH] if keepalive_workaround else [MILES]
    argv = [*launcher, "train", recipe, *overrides, f"run.out_dir={out_dir}", f"run.name={name}",
            "metrics.progress=false", "metrics.tensorboard=false"]
    res = run_process(argv, log=out_dir / f"{name}.log", timeout=timeout)
    path = out_dir / name / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    res.update(rows=rows, train=[r for r in rows if r["kind"] == "train"], argv=argv)
    train = res["train"]
    last = train[-1] if train else {}
    res["failed_trajectories"] = sum(v for k, v in last.items() if k.startswith("buffer/failed_trajectories/"))
    res["dropped_groups"] = last.get("buffer/dropped_total", 0.0)
    text = Path(res["log"]).read_text(errors="replace") if Path(res["log"]).is_file() else ""
    res["tito_mismatch_warnings"] = text.count("differs from the canonical render")
    if res["rc"] != 0:
        tail = Path(res["log"]).read_text()[-4000:]
        res["error"] = f"miles train exited {res['rc']}; log tail:\n{tail}"
    return res


# ---------------------------------------------------------------------------------- statistics
def moving_average(values: Sequence[float], k: int = 3) -> list[float]:
    return [statistics.fmean(values[i:i + k]) for i in range(len(values) - k + 1)]


def thresholds(rewards: Sequence[float], times: Sequence[float], *, rise: float = 0.3,
               level: float = 0.8, k: int = 3) -> dict[str, Any]:
    """3-step moving average: start (mean of steps 1..3), the first step (1-based, the window's last
    step) and its elapsed seconds where the average is >= start + rise, and where it is >= level."""
    ma = moving_average(rewards, k)
    out: dict[str, Any] = {"start": ma[0] if ma else None, "max_ma": max(ma) if ma else None,
                           "end_ma": ma[-1] if ma else None, "rise_step": None, "rise_s": None,
                           "level_step": None, "level_s": None}
    if not ma:
        return out
    for i, v in enumerate(ma):
        step = i + k  # 1-based step that closes the window
        if out["rise_step"] is None and v >= ma[0] + rise - 1e-12:
            out["rise_step"], out["rise_s"] = step, times[step - 1]
        if out["level_step"] is None and v >= level - 1e-12:
            out["level_step"], out["level_s"] = step, times[step - 1]
    return out


def med(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def med_range(values: Sequence[float | None], fmt: str = "{:.2f}") -> str:
    vals = [v for v in values if v is not None]
    missing = len(values) - len(vals)
    if not vals:
        return "–"
    text = fmt.format(statistics.median(vals))
    if len(vals) > 1:
        text += f" [{fmt.format(min(vals))}–{fmt.format(max(vals))}]"
    if missing:
        text += f" ({missing} n/a)"
    return text


def cell(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return fmt.format(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pasteable into the closing note)."""
    text = [[str(h) for h in headers]] + [[cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(text[0]), sep, *(line(r) for r in text[1:])])


def load_info() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def finish(out: Path, text: str, runs: list[dict[str, Any]], ckpt_info: dict[str, Any], args: Any, t0: float) -> None:
    """Print the report and write ``results.json`` + ``report.md`` under ``out``."""
    print()
    print(text)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; {load_info()}; results in {out / 'results.json'}")
    (out / "results.json").write_text(json.dumps({"runs": runs, "checkpoint": ckpt_info, "args": vars(args)},
                                                 default=str, indent=1))
    (out / "report.md").write_text(text + "\n")
