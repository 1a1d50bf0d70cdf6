"""``speculative`` options of the vllm, sglang, embedded and server kinds: typed, mapped to each
engine's own flags, every inconsistent or inexact setting refused with one error (no server starts)."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from pydantic import ValidationError

from miles_engine.engines.fleet.config import (EmbeddedKindOptions, EngineGroupConfig, ServerKindOptions,
                                               SGLangKindOptions)
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.fleet.server import ServerKind
from miles_engine.engines.fleet.sglang_kind import SGLangKind
from miles_engine.engines.fleet.vllm_kind import VllmKind
from miles_engine.engines.sglang import SGLangLaunchConfig, build_command
from miles_engine.engines.sglang_options import SGLangSpeculativeOptions
from miles_engine.engines.vllm.options import VllmKindOptions, VllmSpeculativeOptions, default_python
from miles_engine.errors import ConfigError


def _spec_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_vllm_speculative_config_json(tmp_path: Path) -> None:
    ctx = FleetContext(model="m", state_dir=tmp_path)
    cases = [
        (dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5),
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
        (dict(method="draft_model", num_speculative_tokens=3, model="/m/draft"),
         {"method": "draft_model", "num_speculative_tokens": 3, "model": "/m/draft"}),
        (dict(method="eagle3", num_speculative_tokens=2, model="/m/eagle3", draft_tensor_parallel_size=1),
         {"method": "eagle3", "num_speculative_tokens": 2, "model": "/m/eagle3", "draft_tensor_parallel_size": 1}),
        (dict(method="mtp", num_speculative_tokens=1), {"method": "mtp", "num_speculative_tokens": 1}),
    ]
    for options, want in cases:
        kind = VllmKind(VllmKindOptions(speculative=options))
        assert _spec_config(kind.command(EngineGroupConfig(kind="vllm"), ctx, 0, "/models/x")) == want
    plain = VllmKind(VllmKindOptions()).command(EngineGroupConfig(kind="vllm"), ctx, 0, "x")
    assert "--speculative-config" not in plain


def test_vllm_keys_are_fields_of_vllms_speculative_config() -> None:
    """Checked against the installed vLLM's source (no import: seconds saved), when there is one."""
    site = sorted(Path(default_python()).parents[1].glob("lib/python*/site-packages/vllm/config/speculative.py"))
    if not site:
        pytest.skip("no vLLM environment here")
    source = site[0].read_text()
    for key in set(VllmSpeculativeOptions.model_fields) - {"train"}:  # ours: refused, never passed on
        assert re.search(rf"^    {key}: ", source, re.M), key
    methods = VllmSpeculativeOptions.model_fields["method"].annotation.__args__
    for method in methods:
        assert f'"{method}"' in source, method


@pytest.mark.parametrize("bad,match", [
    (dict(method="medusa", num_speculative_tokens=2), "method"),
    (dict(method="ngram"), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="draft_model", num_speculative_tokens=2), "needs model"),
    (dict(method="ngram", num_speculative_tokens=2, model="/d"), "takes no model"),
    (dict(method="eagle", num_speculative_tokens=2, model="/d", prompt_lookup_max=3), "'ngram' only"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=3), "larger than"),
    (dict(method="ngram", num_speculative_tokens=2, rejection_sample_method="synthetic"), "Extra inputs"),
    (dict(method="draft_model", num_speculative_tokens=2, model="/d", train=True), "co-train a draft with kind embedded"),
])
def test_vllm_bad_speculative_options(bad: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match) as info:
        VllmKindOptions(speculative=bad)
    assert len(info.value.errors()) == 1


def test_raw_speculative_flags_in_extra_args_are_refused_with_the_migration() -> None:
    for model in (VllmKindOptions, SGLangKindOptions):
        with pytest.raises(ValidationError, match="set with options.speculative"):
            model(extra_args=["--speculative-config", "{}"])
    with pytest.raises(ValueError, match="not with --speculative-\\* flags in extra_args"):
        build_command(SGLangLaunchConfig("/m", extra_args=["--speculative-algorithm", "EAGLE"]), 1)


def test_sglang_typed_flags_and_the_mapping_recipes_used() -> None:
    legacy = {"algorithm": "EAGLE", "draft_model_path": "/d", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    typed = SGLangSpeculativeOptions(**legacy)
    for spec in (legacy, typed):
        cmd = build_command(SGLangLaunchConfig("/m", speculative=spec), 1)
        i = cmd.index("--speculative-algorithm")
        assert cmd[i : i + 10] == ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d",
                                   "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                   "--speculative-num-draft-tokens", "4"]
    ngram = SGLangSpeculativeOptions(algorithm="ngram", num_draft_tokens=8, ngram_min_match_window_size=2,
                                     ngram_max_match_window_size=6)
    assert ngram.flags() == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
                             "--speculative-ngram-min-match-window-size", "2",
                             "--speculative-ngram-max-match-window-size", "6"]
    assert SGLangSpeculativeOptions(algorithm="NEXTN", num_steps=1).flags()[:2] == ["--speculative-algorithm", "NEXTN"]
    assert "--speculative-algorithm" not in build_command(SGLangLaunchConfig("/m", speculative={}), 1)


@pytest.mark.parametrize("bad,match", [
    ({"algo": "EAGLE"}, "algo"),
    ({"algorithm": "LOOKAHEAD"}, "algorithm"),
    ({"algorithm": "EAGLE3"}, "needs draft_model_path"),
    ({"algorithm": "NGRAM", "draft_model_path": "/d"}, "takes no draft_model_path"),
    ({"algorithm": "EAGLE", "draft_model_path": "/d", "ngram_max_match_window_size": 4}, "NGRAM only"),
    ({"algorithm": "NGRAM", "ngram_min_match_window_size": 5, "ngram_max_match_window_size": 2}, "larger than"),
    ({"algorithm": "EAGLE", "draft_model_path": "/d", "accept_threshold_single": 0.5}, "accept_threshold_single"),
    ({"algorithm": "STANDALONE", "draft_model_path": "/d", "train": True}, "co-train a draft with kind embedded"),
])
def test_sglang_bad_speculative_options(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_command(SGLangLaunchConfig("/m", speculative=bad), 1)
    with pytest.raises(ValidationError, match=match):
        SGLangKindOptions(speculative=bad)


def test_sglang_ngram_on_a_cpu_group_is_refused(tmp_path: Path) -> None:
    kind = SGLangKind(SGLangKindOptions(model_path="/m", speculative={"algorithm": "NGRAM"}))

    async def main() -> None:
        async with AsyncExitStack() as stack:
            await kind.start(EngineGroupConfig(kind="sglang", device="cpu"), "sg",
                             FleetContext(model="/m", state_dir=tmp_path), stack)

    with pytest.raises(ConfigError, match="NGRAM runs on CUDA only"):
        asyncio.run(main())


def test_embedded_and_server_kinds_take_the_engines_own_speculative_options(tmp_path: Path) -> None:
    spec = {"method": "ngram", "num_tokens": 3, "prompt_lookup_max": 2}
    assert EmbeddedKindOptions(speculative=spec).speculative.num_tokens == 3
    with pytest.raises(ValidationError, match="needs draft_model"):
        EmbeddedKindOptions(speculative={"method": "draft"})
    kind = ServerKind(ServerKindOptions(speculative=spec))
    argv = kind.command(EngineGroupConfig(kind="server"), FleetContext(model="tiny:qwen3", state_dir=tmp_path), 0)
    sent = json.loads(argv[argv.index("--engine-options") + 1])["speculative"]
    assert sent == {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2, "backoff": True,
                    "draft_model": None, "train": False, "train_lr": 1e-4, "train_epochs": 1,
                    "train_batch_tokens": 8192}
