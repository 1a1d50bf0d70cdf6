"""``miles export``: a LoRA run on an HF-directory model source, exported merged (transformers
loads it and its greedy output equals the embedded engine's and the trainer's) and as a peft
adapter directory (peft applies it to the base: same logits)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.errors import ConfigError
from miles_engine.checkpoint.export import export_run
from miles_engine import checkpoint
from miles_engine.trainer.torch_trainer import TorchTrainer
from miles_engine.models.tokenizer import load_tokenizer

torch.set_num_threads(1)
LORA = {"enabled": True, "rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"]}
PROMPT = [1, 30, 31, 32, 33, 34]


def _base_dir(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer("builtin:bpe-chatml")
    base = root / "base"
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=tok.added_tokens["<|im_end|>"])
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(str(base))
    tok.backend.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                                                     "{{ m.content }}<|im_end|>\n{% endfor %}"}))
    return base


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    base = _base_dir(root)
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base)}, "trainer": {"lora": LORA}}))
    trainer = TorchTrainer(str(base), {"lora": LORA, "optimizer": {"lr": 5e-2}})
    rows = [([1, 30, 31, 32, 40, 41, 42, 43], [0, 0, 0, 0, 1, 1, 1, 1])] * 4
    for _ in range(4):
        trainer.sft_step(rows)
    checkpoint.save(run, step=4, trainer_state=trainer.state_dict(), rollout=checkpoint.RolloutState(cursor=0),
                    rng=checkpoint.rng_states(), manifest={}, keep=1)
    return run, base, trainer


def _engine_greedy(model_dir: Path, n: int) -> list[int]:
    async def main():
        engine = EmbeddedEngine.from_model(str(model_dir), num_threads=1, max_context=64)
        try:
            res = await engine.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=n)))
            return res.output_ids
        finally:
            await engine.aclose()
    return asyncio.run(main())


def test_merged_export_loads_in_transformers_and_generates_like_the_engine(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, base, trainer = run_dir
    dest = tmp_path / "merged"
    result = CliRunner().invoke(cli, ["export", str(run), "--merged", str(dest)])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(str(dest), local_files_only=True).eval()
    assert AutoTokenizer.from_pretrained(str(dest)).chat_template  # the source's template travels with it
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        hf = out[0, len(PROMPT):].tolist()
        # the merged weights compute what the adapted trainer computes
        gap = (model(input_ids=ids).logits - trainer.policy(input_ids=ids).logits).abs().max().item()
    assert gap < 1e-4
    assert hf == _engine_greedy(dest, 8)
    base_model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True)
    assert not torch.equal(base_model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(base_model.model.layers[0].self_attn.k_proj.weight, model.model.layers[0].self_attn.k_proj.weight)


def test_adapter_export_applies_with_peft(run_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, base, trainer = run_dir
    dest = export_run(run, tmp_path / "adapter")
    assert (dest / "adapter_model.safetensors").is_file() and not (dest / "model.safetensors").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(dest)).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        gap = (model(input_ids=ids).logits - trainer.policy(input_ids=ids).logits).abs().max().item()
    assert gap < 1e-5


def test_export_refuses_a_non_empty_destination_and_a_from_scratch_run(run_dir, tmp_path):
    run, _, _ = run_dir
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_run(run, tmp_path / "full")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "config.yaml").write_text(yaml.safe_dump({"model": {"path": None}}))
    with pytest.raises(ConfigError, match="from-scratch"):
        export_run(scratch, tmp_path / "out")
    assert not list(tmp_path.glob(".out.tmp-*"))
