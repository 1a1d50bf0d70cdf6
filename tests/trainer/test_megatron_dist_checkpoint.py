"""trainer.megatron.checkpoint_format=dist: every rank writes its shards in megatron-core's
distributed format into the staged run checkpoint; a resume in another TP layout (TP=2 -> TP=1)
continues exactly like the uninterrupted run (weights, Adam moments, schedule, counters); the
checkpoint exports to an HF directory (`miles export`); the torch backend refuses it with one error;
PP=2 (tied embedding) and EP=2 (MoE) checkpoints load on one rank, moments bit exact. Several sets of
rank processes (~10 s of megatron import each)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from miles_engine.errors import ConfigError  # noqa: E402
from miles_engine import checkpoint
from miles_engine.trainer.factory import create_trainer  # noqa: E402
from miles_engine.trainer.megatron import dist_checkpoint  # noqa: E402
from tests.trainer.helpers import MOE, TINY, random_groups  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.slow  # several sets of rank processes (~10-20 s each to start here)
CFG = {"backend": "megatron", "optimizer": {"lr": 1e-2}, "max_tokens_per_micro_batch": 48,
       "lr_schedule": {"warmup_steps": 3}}
SFT_ROWS = [([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 1, 1, 1]), ([9, 8, 7, 6, 5], [0, 0, 1, 1, 1])]


def _save(trainer, run_dir, step: int):
    staged = checkpoint.stage(run_dir, step)
    state = trainer.save_shards(staged / trainer.checkpoint_shards)
    return checkpoint.save(run_dir, step=step, trainer_state=state, rollout=checkpoint.RolloutState(cursor=step),
                           rng=checkpoint.rng_states(), manifest={}, keep=3, staged=staged)


def test_tp2_dist_checkpoint_resumes_at_tp1_exactly_and_converts(tmp_path) -> None:
    model = dict(TINY)  # tied embeddings: the vocab-split embedding is resharded too
    with create_trainer(model, {**CFG, "megatron": {"tensor_parallel": 2, "checkpoint_format": "dist"}},
                        world_size=2) as tp2:
        assert tp2.checkpoint_shards == dist_checkpoint.SUBDIR
        tp2.sft_step(SFT_ROWS)
        tp2.train_step(random_groups(3, 3, seed=1))
        path = _save(tp2, tmp_path, 1)
        saved = dict(tp2.named_tensors())
        moments = tp2.state_dict()["optimizer"]["state"]  # gathered under HF names, to compare
        uninterrupted = tp2.train_step(random_groups(3, 3, seed=2))
        after = dict(tp2.named_tensors())
        checkpoint.stage(tmp_path, 2)  # a save killed while the ranks wrote: never picked up
    files = checkpoint.load(path).manifest["files"]
    assert any(name.startswith(f"{dist_checkpoint.SUBDIR}/") and name.endswith(".distcp") for name in files)
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded.path == path and not list(tmp_path.glob("checkpoints/.tmp-*"))
    state = loaded.trainer_state
    assert dist_checkpoint.is_dist(state) and state["model"] == {} and state["megatron_layout"]["tp"] == 2
    with pytest.raises(ConfigError, match="trainer.backend=megatron"):
        dist_checkpoint.check_backend(state, "torch", path)

    with create_trainer(model, {**CFG, "megatron": {"tensor_parallel": 1}}, world_size=1) as tp1:
        tp1.load_state_dict(state)
        assert tp1.weight_version == 2
        resumed = dict(tp1.named_tensors())
        assert resumed.keys() == saved.keys()
        assert all(torch.equal(resumed[k], saved[k]) for k in saved)
        restored = tp1.state_dict()["optimizer"]["state"]
        assert restored.keys() == moments.keys()
        for name, m in moments.items():  # Adam's moments resharded TP=2 -> TP=1 bit exact
            assert restored[name]["step"] == m["step"]
            assert all(torch.equal(restored[name][k], m[k]) for k in ("exp_avg", "exp_avg_sq")), name
        step = tp1.train_step(random_groups(3, 3, seed=2))  # moments, schedule and counters restored
        for k in ("loss", "pg_loss", "grad_norm", "lr", "weight_version"):
            assert step[k] == pytest.approx(uninterrupted[k], abs=1e-5), k
        final = dict(tp1.named_tensors())
        assert max((final[k] - after[k]).abs().max().item() for k in after) < 1e-5

    # miles export: one TP=1 rank reads the TP=2 shards onto the run's model source (here an HF
    # directory holding other weights: what is exported must be the checkpoint's)
    import yaml

    from miles_engine.models.loading import load_model
    from miles_engine.checkpoint.export import export_run
    from miles_engine.trainer.megatron.convert import to_hf_dir

    base = to_hf_dir(after, model, tmp_path / "base")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base)}}))
    exported, _ = load_model(str(export_run(tmp_path, tmp_path / "hf", merged=True)))
    assert all(torch.equal(v, saved[k]) for k, v in exported.state_dict().items())


@pytest.mark.parametrize("model,sizes", [(TINY, {"pipeline_parallel": 2}),  # tied embedding on both stages
                                         (dict(MOE, tie_word_embeddings=False), {"expert_parallel": 2})],
                         ids=["pp2", "ep2_moe"])
def test_pp2_and_ep2_dist_checkpoints_resume_on_one_rank(tmp_path, model, sizes) -> None:
    with create_trainer(dict(model), {**CFG, "megatron": {**sizes, "checkpoint_format": "dist"}}, world_size=2) as a:
        a.sft_step(SFT_ROWS)
        a.train_step(random_groups(3, 3, seed=1))
        path = _save(a, tmp_path, 1)
        moments, saved = a.state_dict()["optimizer"]["state"], dict(a.named_tensors())
        uninterrupted = a.train_step(random_groups(3, 3, seed=2))
    with create_trainer(dict(model), CFG, world_size=1) as b:
        b.load_state_dict(checkpoint.load(path).trainer_state)
        restored, resumed = b.state_dict()["optimizer"]["state"], dict(b.named_tensors())
        step = b.train_step(random_groups(3, 3, seed=2))
    assert all(torch.equal(resumed[k], saved[k]) for k in saved)
    assert all(torch.equal(restored[n][k], m[k]) for n, m in moments.items() for k in ("exp_avg", "exp_avg_sq"))
    assert step["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], abs=1e-5)
